"""Instructions, not seconds: inspect's and plan's cost beyond start-up against the bare header parse, counted by
valgrind (bench only, not CI; needs `valgrind` on PATH).

On this shared 2-core VM CPU seconds drift by up to 1.5x between minutes, so a change of a few percent cannot be
told from noise by timing. Instruction counts (cachegrind, no cache simulation) are the same from run to run: this
script counts `kconvert --version`, `inspect`, `plan --tp 8 --quant fp8` (each through the console entry point, as
metadata_bench.py runs them) and a plain process's `json.loads` of every header (minus the same process reading
them), for this tree and, with --vs, for another one, side by side. Instructions are not time: the conversion's
many small objects cost more cache misses per instruction than json.loads does, so its time ratios are higher
(metadata_bench.py gives those). Each count takes ~10 s (valgrind runs Python about 20x slower).

    .venv/bin/python bench/instructions.py /tmp/kmeta/topo-k25-bf16-L-E
    .venv/bin/python bench/instructions.py /tmp/kmeta/topo-k25-bf16-L-E --vs /tmp/base   # a worktree of another commit
    .venv/bin/python bench/instructions.py /tmp/kmeta/topo-k25-11 --vs /tmp/base --shard none,fp8  # + whole shards
    .venv/bin/python bench/instructions.py /tmp/kmeta/topo-k25-bf16-L-E --vs /tmp/base --phases   # + fold, validation

With --shard, each tree also runs `shard SRC --tp 8 --quant Q --workers 1` (one worker: the same work in the same
order every run) and its whole count is shown, torch's import included: on a smaller topology, since valgrind
makes a 4 s shard a minute or more (`kconvert fixture topo-k25 /tmp/kmeta/topo-k25-11 --layers 11`).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from _cli import ENTRY, ROOT, compiled  # a sibling module: bench/ is this script's folder

_READ = """
import json, struct, sys
raws = []
for f in sys.argv[1:]:
    with open(f, "rb") as fh:
        raws.append(fh.read(struct.unpack("<Q", fh.read(8))[0]))
"""


def instructions(code: str, *args, cwd: Path) -> int:
    """Instructions a fresh `python -c CODE ARGS` executes (PYTHONHASHSEED fixed: the same count every run)."""
    cmd = ["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
           sys.executable, "-c", code, *map(str, args)]
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": "0"})
    m = re.search(r"I\s+refs:\s+([\d,]+)", r.stderr)
    if r.returncode or m is None:
        raise SystemExit(f"valgrind {' '.join(map(str, args))} failed ({r.returncode}): {r.stderr[-1500:]}")
    return int(m.group(1).replace(",", ""))


def counts(tree: Path, src: Path) -> dict[str, int]:
    files = sorted(src.glob("*.safetensors"))
    instructions(ENTRY, "inspect", src, "--json", cwd=tree)  # once first: a fresh tree compiles its bytecode
    return {"start-up": instructions(ENTRY, "--version", cwd=tree),
            "inspect": instructions(ENTRY, "inspect", src, "--json", cwd=tree),
            "plan": instructions(ENTRY, "plan", src, "--tp", 8, "--quant", "fp8", "--json", cwd=tree),
            "floor": instructions(_READ + "[json.loads(r) for r in raws]\n", *files, cwd=tree)
            - instructions(_READ, *files, cwd=tree)}


_OPENED = "import gc; gc.disable(); from kconvert.source.checkpoint import Checkpoint; ck = Checkpoint.open({src!r})\n"
PHASES = {"fold into logical tensors": "from kconvert.source.logical import fold; fold(ck.stored)",
          "validate (group_tensors)": "from kconvert.source.tensor_groups import group_tensors; "
                                      "group_tensors(ck.model, ck.logical)"}


def phase_counts(tree: Path, src: Path) -> dict[str, int]:
    """Instructions of each of PHASES once more on an opened checkpoint, minus opening it (collector paused, as
    Checkpoint.open pauses it)."""
    opened = _OPENED.format(src=str(src))
    base = instructions(opened, cwd=tree)
    return {name: instructions(opened + code, cwd=tree) - base for name, code in PHASES.items()}


def shard_count(tree: Path, src: Path, quant: str) -> int:
    with tempfile.TemporaryDirectory(prefix="instr-shard-") as tmp:
        return instructions(ENTRY, "shard", src, Path(tmp) / "out", "--tp", 8, "--quant", quant, "--workers", 1,
                            cwd=tree)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path, help="A source checkpoint (e.g. a metadata_bench.py fixture).")
    ap.add_argument("--vs", type=Path, help="Another tree (a git worktree) to count the same commands in.")
    ap.add_argument("--phases", action="store_true", help="Also count folding and validation alone (PHASES).")
    ap.add_argument("--shard", default="", help="Also count whole shards with these --quant modes (comma-separated).")
    a = ap.parse_args(argv)
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed: this bench counts instructions with it")
    trees = {"this tree": ROOT, **({f"{a.vs}": a.vs} if a.vs else {})}
    for root in trees.values():
        compiled(root)
    print(f"{a.src}: millions of instructions (PYTHONHASHSEED=0)")
    print("| tree | start-up | json.loads floor | inspect beyond start-up | × floor | plan beyond start-up | × floor |")
    print("|---|---|---|---|---|---|---|")
    for name, tree in trees.items():
        c = counts(tree, a.src)
        ins, plan = c["inspect"] - c["start-up"], c["plan"] - c["start-up"]
        print(f"| {name} | {c['start-up'] / 1e6:.0f} | {c['floor'] / 1e6:.0f} | {ins / 1e6:.0f} | {ins / c['floor']:.2f} "
              f"| {plan / 1e6:.0f} | {plan / c['floor']:.2f} |")
    if a.phases:
        counts_by_tree = {name: phase_counts(tree, a.src) for name, tree in trees.items()}
        for phase in PHASES:
            print(f"{phase}: " + ", ".join(f"{name} {c[phase] / 1e6:,.0f}M" for name, c in counts_by_tree.items()))
    for quant in filter(None, a.shard.split(",")):
        print(f"shard --tp 8 --quant {quant} --workers 1, whole process: " + ", ".join(
            f"{name} {shard_count(tree, a.src, quant) / 1e6:,.0f}M" for name, tree in trees.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
