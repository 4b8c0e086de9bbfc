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
    "kconvert.quant",      # quantization schemes, their registry and policy
    "kconvert.source",     # source checkpoints: hub, index, formats, tokenizer
    "kconvert.disk_format",  # the converted directory's on-disk format (kconvert.json, rank lists, units, journal)
    "kconvert.convert",    # layout, quantization, shard plan, shard, pack
    "kconvert.load",       # devices, streaming loader
    "kconvert.testing",    # the stand-in accelerator (tests, the device check's dry run)
    "kconvert.plan",       # memory plan, KV bytes
    "kconvert.inspect",    # what a checkpoint or a converted directory holds
    "engine",              # the engine's base: model hyper-parameters (config), the forward across stages (pipeline)
    "engine.layers",       # building blocks of every family: linear weights in stored formats, slots, rotary
    "engine.cache",        # decode caches and their byte formats, the host tier
    "engine.models",       # one package per model family (its blocks, cache, draft heads, vision), the kind registry
    "engine.inputs",       # tokenizer, chat template, image preprocessing: what chat and verify feed the engine
    "engine.draft",        # the draft-head kinds' registry and the drafters that run them
    "engine.model",        # the model assembled from a converted checkpoint's units
    "engine.runtime",      # generation, launching ranks, time-to-ready, tp checks
    "engine.calibrate",    # GPTQ layer by layer through the engine
    "engine.chat",         # python -m engine.chat
    "kconvert.verify",     # prompts, reference, statistics, verify runs
    "kconvert.fixtures",   # test checkpoints built with transformers
    "cli",                 # the click application
]
PACKAGES = ("kconvert", "engine", "cli")
LONG = 300  # lines; a longer file says why in its docstring ("over 300 lines": ...)


def module_name(path: Path, root: Path = ROOT) -> str:
    rel = path.relative_to(root).with_suffix("")
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


def imports_of(path: Path, modules: set[str], root: Path = ROOT) -> set[str]:
    """Every project module `path` imports, at any depth in the file."""
    me = module_name(path, root)
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


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    files = [p for pkg in PACKAGES for p in (root / pkg).rglob("*.py")]
    modules = {module_name(p, root) for p in files}
    return {module_name(p, root): imports_of(p, modules, root) - {module_name(p, root).rpartition(".")[0]}
            for p in files}


def upward_imports(g: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} ({STAGES[stage_of(m)]}) imports {d} ({STAGES[stage_of(d)]})"
                  for m, deps in g.items() for d in deps if stage_of(d) > stage_of(m))


def import_cycles(g: dict[str, set[str]]) -> list[list[str]]:
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
    return cycles


def long_files_without_a_reason(root: Path = ROOT) -> list[str]:
    long = []
    for folder in PACKAGES + ("tests", "bench", "tools"):
        for p in (root / folder).rglob("*.py"):
            text = p.read_text()
            lines = text.count("\n")
            if lines > LONG and f"over {LONG} lines" not in (ast.get_docstring(ast.parse(text)) or "").lower():
                long.append(f"{p.relative_to(root)} ({lines} lines)")
    return sorted(long)


def test_every_import_points_down_the_stage_order():
    bad = upward_imports(graph())
    assert not bad, "imports pointing up the stage order:\n" + "\n".join(bad)


def test_no_import_cycles():
    cycles = import_cycles(graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_long_files_say_why():
    """Files stay small (one concern each): a module, test or benchmark over LONG lines says why in its docstring."""
    long = long_files_without_a_reason()
    assert not long, f"files over {LONG} lines without a reason in their docstring: " + ", ".join(long)


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    for pkg in PACKAGES + ("tests", "bench", "tools"):
        (root / pkg).mkdir(exist_ok=True)
    return root


def test_the_checkers_fail_on_a_synthetic_violation(tmp_path):
    """Negative controls, so the checks above cannot pass vacuously: a tree with an upward import (a lazy
    one, inside a function), one with a cycle, and one with a long test file each fail their checker; the
    same trees without the violation pass it."""
    base = {"kconvert/__init__.py": "", "kconvert/io/__init__.py": "", "kconvert/convert/__init__.py": ""}
    up = _tree(tmp_path / "up", {**base, "kconvert/convert/shard/job.py": "X = 1\n",
                                "kconvert/io/atomic.py": "def f():\n    from kconvert.convert.shard.job import X\n"})
    assert upward_imports(graph(up)) == ["kconvert.io.atomic (kconvert.io) imports kconvert.convert.shard.job "
                                         "(kconvert.convert)"]
    assert not import_cycles(graph(up))
    # inside the engine: a shared building block reaching up into a family's package
    eng = {"engine/__init__.py": "", "engine/layers/__init__.py": "", "engine/models/__init__.py": "",
           "engine/models/deepseek_v3/__init__.py": "", "engine/models/deepseek_v3/mla.py": "class MLA: ...\n"}
    inside = _tree(tmp_path / "inside", {**eng, "engine/layers/linear.py": "from engine.models.deepseek_v3.mla import MLA\n"})
    assert upward_imports(graph(inside)) == ["engine.layers.linear (engine.layers) imports engine.models.deepseek_v3.mla "
                                             "(engine.models)"]
    down = _tree(tmp_path / "down", {**eng, "engine/models/deepseek_v3/moe.py": "from engine.layers import linear\n",
                                     "engine/layers/linear.py": "X = 1\n"})
    assert not upward_imports(graph(down))
    cyc = _tree(tmp_path / "cyc", {**base, "kconvert/io/a.py": "from kconvert.io import b\n",
                                  "kconvert/io/b.py": "def f():\n    from . import a\n"})
    assert import_cycles(graph(cyc)) == [["kconvert.io.a", "kconvert.io.b", "kconvert.io.a"]]
    assert not upward_imports(graph(cyc))
    body = "x = 1\n" * (LONG + 1)
    long = _tree(tmp_path / "long", {**base, "tests/test_big.py": body,
                                    "bench/big_bench.py": f'"""Over {LONG} lines: one table."""\n' + body})
    assert long_files_without_a_reason(long) == [f"tests/test_big.py ({LONG + 1} lines)"]
