"""Pipeline-parallel prefill on CPU: the prompt in one piece vs split into micro-batches (so the stages
overlap), side by side on the same conversion, plus the same model in one process as the baseline.

    .venv/bin/python bench/pp_bench.py --pp 2 --length 1024 --chunks 0,512,256,128 --repeat 3

Builds small-k25-dsv32 (7 layers) in a temporary directory, converts it with --pp P (tp 1), and runs
`torchrun --nproc-per-node P bench/pp_bench.py --worker ...` for each chunk size in turn (round robin,
--repeat rounds; the best time of each setting is kept). Each rank has one thread, so P stages use P
cores. Prints prefill seconds, tokens/s and the ratio against the unsplit prompt; also checks that the
last position's logits of every setting agree with the unsplit run (chunked prefill is exact).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from _cli import ROOT  # first: this tree's kconvert and engine on sys.path


def worker(a) -> None:
    """One rank: load, one warm-up, then time prefill of --length tokens with --chunk micro-batches."""
    from engine.model import Model
    from kconvert.distributed import Group

    torch.set_num_threads(1)
    par = Group.from_env("cpu")
    model = Model.from_converted(a.out, dtype=torch.float32, par=par)
    model.materialize()
    model.prefill_chunk = a.chunk
    ids = torch.randint(0, model.cfg.vocab_size, (1, a.length), generator=torch.Generator().manual_seed(0))
    model.forward(ids[:, :64], last_only=True)  # warm-up (allocations, thread pools)
    model.par.barrier()
    t0 = time.perf_counter()
    logits = model.forward(ids, last_only=True)
    model.par.barrier()
    seconds = time.perf_counter() - t0
    if model.par.rank == 0:
        print(json.dumps({"seconds": seconds, "last": logits[0, -1, :8].tolist()}))
    model.par.close()


def run(out: Path, world: int, chunk: int, length: int) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), __file__, "--worker",
           "--out", str(out), "--chunk", str(chunk), "--length", str(length)]
    if world == 1:
        cmd = [sys.executable, __file__, "--worker", "--out", str(out), "--chunk", str(chunk), "--length", str(length)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        sys.exit(f"worker failed:\n{proc.stderr[-3000:]}")
    return json.loads([l for l in proc.stdout.splitlines() if l.startswith("{")][-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out")
    ap.add_argument("--chunk", type=int, default=0)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--chunks", default="0,512,256,128", help="micro-batch sizes in tokens (0: no split)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--preset", default="small-k25-dsv32")
    a = ap.parse_args()
    if a.worker:
        worker(a)
        return
    from kconvert.convert.shard.job import ShardJob, shard
    from kconvert.convert.layout import Topology
    from kconvert.fixtures import build_fixture

    chunks = [int(c) for c in a.chunks.split(",")]
    with tempfile.TemporaryDirectory(prefix="pp-bench-") as tmp:
        src = build_fixture(a.preset, Path(tmp) / a.preset)
        one, piped = Path(tmp) / "pp1", Path(tmp) / f"pp{a.pp}"
        shard(ShardJob(str(src), str(one), topology=Topology(tp=1)))
        shard(ShardJob(str(src), str(piped), topology=Topology(tp=1, pp=a.pp)))
        settings = [("1 process", one, 1, 0)] + [(f"pp {a.pp}, chunk {c or 'none'}", piped, a.pp, c) for c in chunks]
        best: dict[str, dict] = {}
        for _ in range(a.repeat):  # round robin: the machine's noise hits every setting alike
            for name, out, world, chunk in settings:
                r = run(out, world, chunk, a.length)
                if name not in best or r["seconds"] < best[name]["seconds"]:
                    best[name] = r
    base = best[f"pp {a.pp}, chunk none"]["seconds"]
    ref = torch.tensor(best["1 process"]["last"])
    print(f"{a.preset}, fp32, tp 1, prefill of {a.length} tokens, 1 thread per rank, best of {a.repeat}")
    print(f"{'setting':<24}{'seconds':>9}{'tokens/s':>10}{'vs unsplit':>12}{'max |Δ logit|':>15}")
    for name, *_ in settings:
        r = best[name]
        d = (torch.tensor(r["last"]) - ref).abs().max().item()
        print(f"{name:<24}{r['seconds']:>9.2f}{a.length / r['seconds']:>10.0f}{base / r['seconds']:>11.2f}x{d:>15.2e}")


if __name__ == "__main__":
    main()
