"""The tree shows the pipeline: imports point one way along the stage order, and no module imports
itself back through others (imports inside functions count: a lazy import hides a cycle, it does not
remove it). docs/ARCHITECTURE.md explains the stages."""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import ROOT

# The stage order, written down once. A module may import from its own stage or an earlier one.
# `engine` sits between `load` (it reads converted checkpoints through the loader) and `verify`
# (which runs the engine against the reference).
STAGES = [
    "kconvert",            # errors, devices, distributed: used by every stage
    "kconvert.io",         # safetensors read/write, compressed shards, atomic writes
    "kconvert.family",     # family manifests and their shape expressions
    "kconvert.source",     # source checkpoints: hub, index, formats, tokenizer
    "kconvert.converted",  # the converted-directory contract (kconvert.json, units, journal)
    "kconvert.convert",    # layout, quantization, shard plan, shard, pack
    "kconvert.load",       # devices, streaming loader
    "kconvert.plan",       # inspect, memory plan, KV bytes
    "engine",              # the model runtime
    "kconvert.verify",     # prompts, reference, statistics, verify runs
    "kconvert.fixtures",   # test checkpoints built with transformers
    "cli",                 # the click application
]
PACKAGES = ("kconvert", "engine", "cli")


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def stage_of(module: str) -> int:
    best = -1
    for i, stage in enumerate(STAGES):
        if module == stage or module.startswith(stage + "."):
            if best < 0 or len(stage) > len(STAGES[best]):
                best = i
    assert best >= 0, f"{module} belongs to no stage: add it to STAGES"
    return best


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """Every project module `path` imports, at any depth in the file."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for name in names:
            while name and name not in modules:  # `from pkg import mod` or `from mod import fn`
                name = name.rpartition(".")[0]
            if name and name != me:
                found.add(name)
    return found


def graph() -> dict[str, set[str]]:
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    modules = {module_name(p) for p in files}
    return {module_name(p): imports_of(p, modules) - {module_name(p).rpartition(".")[0]} for p in files}


def test_every_import_points_down_the_stage_order():
    bad = [f"{m} ({STAGES[stage_of(m)]}) imports {d} ({STAGES[stage_of(d)]})"
           for m, deps in graph().items() for d in deps if stage_of(d) > stage_of(m)]
    assert not bad, "imports pointing up the stage order:\n" + "\n".join(sorted(bad))


def test_no_import_cycles():
    g = graph()
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for d in sorted(g.get(m, ())):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d, stack + [d])
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_checker_sees_cycles_and_upward_imports():
    """The checks above fail on a real violation (so they cannot pass vacuously)."""
    g = graph()
    assert g["kconvert.load.loader"] and "kconvert.errors" in g["kconvert.load.loader"]
    assert stage_of("kconvert.verify.run") > stage_of("engine.model") > stage_of("kconvert.load.loader")
    assert stage_of("kconvert.io.compressed") < stage_of("kconvert.source.checkpoint")


def test_long_modules_say_why():
    """Files stay small (one concern each); a module over 300 lines says why in its docstring."""
    long = []
    for pkg in PACKAGES:
        for p in (ROOT / pkg).rglob("*.py"):
            text = p.read_text()
            if text.count("\n") > 300 and "over 300 lines" not in (ast.get_docstring(ast.parse(text)) or "").lower():
                long.append(f"{p.relative_to(ROOT)} ({text.count(chr(10))} lines)")
    assert not long, "modules over 300 lines without a reason in their docstring: " + ", ".join(long)
