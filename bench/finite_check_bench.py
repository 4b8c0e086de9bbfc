"""Cost of the NaN/Inf check on every source read (issue 10), side by side on the `scale` source that
bench/shard_bench.py converts: `kconvert shard --tp 8` in-process with the check and with it stubbed
out, alternated, plus the check alone over every tensor (the bytes it scans per second).

    .venv/bin/python bench/finite_check_bench.py --size 1GB --workdir /tmp/kbench --repeat 3
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

from _cli import fixture  # first: this tree's kconvert and cli on sys.path
from cli.units import fmt_bytes, parse_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1GB")
    ap.add_argument("--workdir", default="/tmp/kbench")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quant", default="none")
    args = ap.parse_args()
    from kconvert.convert.shard.job import ShardJob, shard
    from kconvert.convert.layout import Topology
    from kconvert.quant.policy import QuantPolicy
    from kconvert.io.safetensors_read import read_tensor
    from kconvert.source import formats
    from kconvert.source.checkpoint import Checkpoint

    work = Path(args.workdir)
    src = fixture("scale", work / f"scale-{args.size}", size=parse_size(args.size))
    ck = Checkpoint.open(src)
    nbytes = sum(e.nbytes for e in ck.stored.values())

    t_check = t_read = 0.0
    for e in ck.stored.values():  # the check alone, on data already in memory
        t = time.perf_counter()
        x = read_tensor(e)
        t_read += time.perf_counter() - t
        t = time.perf_counter()
        assert formats.all_finite(x)
        t_check += time.perf_counter() - t
    print(f"source {fmt_bytes(nbytes)}: read {nbytes / t_read / 1e9:.2f} GB/s, check {nbytes / t_check / 1e9:.2f} GB/s "
          f"({t_check:.2f} s for every tensor)")

    real = formats.all_finite
    times: dict[str, list[float]] = {"checked": [], "unchecked": []}
    for _ in range(args.repeat):
        for mode in ("checked", "unchecked"):
            formats.all_finite = real if mode == "checked" else (lambda x: True)
            out = work / "finite-bench-out"
            shutil.rmtree(out, ignore_errors=True)
            t = time.perf_counter()
            shard(ShardJob(str(src), str(out), topology=Topology(tp=8), quant=QuantPolicy(scheme=args.quant), workers=2))
            times[mode].append(time.perf_counter() - t)
    formats.all_finite = real
    shutil.rmtree(work / "finite-bench-out", ignore_errors=True)
    best = {k: min(v) for k, v in times.items()}
    print(f"shard --tp 8 --quant {args.quant} --workers 2, best of {args.repeat}: checked {best['checked']:.2f} s, "
          f"unchecked {best['unchecked']:.2f} s, ratio {best['checked'] / best['unchecked']:.3f}")


if __name__ == "__main__":
    main()
