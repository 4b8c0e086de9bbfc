"""Conversion throughput and memory, side by side in one run (numbers for docs/BENCHMARKS.md).

For each source size: generate a `scale` checkpoint, then time `cp -r` of it and
`kconvert shard --tp 8` with --quant none and fp8 on the same disk (page cache warm for all three:
this machine cannot drop caches), and record each conversion's peak RSS in its own process.
Prints ratios to cp (page cache) and to cp + sync (on disk, as shard's fsynced files are), and RSS against the 1.5 GB + 3 x largest-tensor budget.

    .venv/bin/python bench/shard_bench.py --sizes 1GB,4GB --workdir /tmp/kbench
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import time
from pathlib import Path

from _cli import fixture, timed_shard  # first: this tree's kconvert and cli on sys.path
from cli.units import fmt_bytes, parse_size


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1GB,4GB")
    ap.add_argument("--workdir", default="/tmp/kbench")
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    from kconvert.source.checkpoint import Checkpoint

    rows = []
    for size_text in args.sizes.split(","):
        size = parse_size(size_text)
        src = fixture("scale", work / f"scale-{size_text}", size=size)
        largest = max(e.nbytes for e in Checkpoint.open(src).stored.values())
        nbytes = du(src)
        subprocess.run(["cat", *map(str, src.glob("*.safetensors"))], stdout=subprocess.DEVNULL, check=True)  # warm
        shutil.rmtree(work / "cp", ignore_errors=True)
        subprocess.run(["sync"], check=True)
        t = time.perf_counter()
        subprocess.run(["cp", "-r", str(src), str(work / "cp")], check=True)
        cp_s = time.perf_counter() - t
        subprocess.run(["sync"], check=True)  # cp's data reaches the disk too: shard fsyncs every file
        cp_sync_s = time.perf_counter() - t
        shutil.rmtree(work / "cp")
        subprocess.run(["sync"], check=True)
        for quant in ("none", "fp8"):
            r = timed_shard(src, work / f"out-{quant}", "--tp", 8, "--quant", quant, "--workers", args.workers)
            shutil.rmtree(work / f"out-{quant}")
            rows.append({"size": size_text, "bytes": nbytes, "quant": quant, "cp_GBps": nbytes / cp_s / 1e9,
                         "cp_sync_GBps": nbytes / cp_sync_s / 1e9, "shard_GBps": nbytes / r["wall"] / 1e9,
                         "ratio_to_cp": cp_s / r["wall"], "ratio_to_cp_sync": cp_sync_s / r["wall"],
                         "peak_rss": r["peak_rss_bytes"], "largest_tensor": largest,
                         "rss_budget": int(1.5e9 + 3 * largest)})
            print(json.dumps(rows[-1]))
    print(f"\n{'size':>6} {'quant':>5} {'cp GB/s':>8} {'cp+sync':>8} {'shard GB/s':>10} {'x cp':>6} {'x cp+sync':>9} "
          f"{'peak RSS':>10} {'budget':>10}")
    for r in rows:
        print(f"{r['size']:>6} {r['quant']:>5} {r['cp_GBps']:8.2f} {r['cp_sync_GBps']:8.2f} {r['shard_GBps']:10.2f} "
              f"{r['ratio_to_cp']:6.2f} {r['ratio_to_cp_sync']:9.2f} "
              f"{fmt_bytes(r['peak_rss']):>10} {fmt_bytes(r['rss_budget']):>10}")


if __name__ == "__main__":
    main()
