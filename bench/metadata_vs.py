"""`inspect`, `plan` and `shard` on a real-topology fixture, this tree against another checkout, interleaved (bench
only).

This 2-core machine's speed drifts over minutes, so two commits are compared run by run: each round runs
`kconvert --version`, `inspect` and `plan --tp T --quant fp8` from the other tree, then from this one, and the
bare `json.loads` of the headers; with `--shard`, each tree's shard rounds as metadata_bench.py measures them
(this checkpoint, the fixed-cost and the data-time ones back to back). It prints each figure's median (CPU
seconds of each process; shard: microseconds per written tensor beyond its data).

    git worktree add /tmp/base <commit>
    .venv/bin/python bench/metadata_vs.py /tmp/base --work /tmp/kmeta      # the fixture metadata_bench.py built
    .venv/bin/python bench/metadata_vs.py /tmp/base --work /tmp/kmeta --shard fp8,none
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from _cli import ROOT, compiled  # first: this tree's kconvert on sys.path
from metadata_bench import (FIXED, WIDE, json_floor, kconvert, shard_round, source, tensor_bytes, variant,
                            written_tensors)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("other", type=Path, help="The checkout to compare against (a git worktree of another commit).")
    ap.add_argument("--work", type=Path, required=True, help="Folder holding the fixture (built if absent).")
    ap.add_argument("--preset", default="topo-k25")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shard", default="", help="Also shard with these --quant modes (comma-separated).")
    a = ap.parse_args(argv)
    src = source(a.work, a.preset)  # metadata_bench.py's, the preset at its own size (built if absent)
    trees = {"other": a.other.resolve(), "this": ROOT}
    for root in trees.values():
        compiled(root)
    steps = {"start-up": ["--version"], "inspect": ["inspect", src, "--json"],
             "plan": ["plan", src, "--tp", a.tp, "--quant", "fp8", "--json"]}
    quants = [q for q in a.shard.split(",") if q]
    if quants:
        checkpoints = (src, variant(a.preset, a.work, FIXED), variant(a.preset, a.work, WIDE))
        scale = tensor_bytes(src) / tensor_bytes(checkpoints[2])
    cpu: dict[tuple[str, str], list[float]] = {}
    per_tensor: dict[tuple[str, str], list[float]] = {}
    floor = []
    for _ in range(a.rounds):
        for tree, root in trees.items():
            for step, args in steps.items():
                cpu.setdefault((tree, step), []).append(kconvert(*args, root=root)["cpu"])
            for quant in quants:
                out = a.work / f"vs-{tree}-{quant}"
                beyond = shard_round(root, quant, a.tp, checkpoints, out, cpu[(tree, "start-up")][-1], scale)[0]
                per_tensor.setdefault((tree, quant), []).append(1e6 * beyond / written_tensors(out))
        floor.append(json_floor(src)[0])
    f = statistics.median(floor)
    print(f"{src}: medians of {a.rounds} interleaved rounds, CPU s; json.loads of the headers {f:.2f} s")
    print("| step | other | this | this − start-up, × the json floor |\n|---|---|---|---|")
    for step in steps:
        o, t = (statistics.median(cpu[(tree, step)]) for tree in trees)
        beyond = "" if step == "start-up" else f"{(t - statistics.median(cpu[('this', 'start-up')])) / f:.1f}×"
        print(f"| {step} | {o:.2f} | {t:.2f} | {beyond} |")
    for quant in quants:
        o, t = (statistics.median(per_tensor[(tree, quant)]) for tree in trees)
        print(f"| shard --quant {quant}: µs per written tensor beyond its data | {o:.1f} | {t:.1f} | |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
