"""Conversion speed and memory with DEFAULT options, side by side with DeepSeek's own inference/convert.py.

Per source size (a generated `scale` checkpoint, page cache warm): DeepSeek's convert.py + `sync` (when
--deepseek names a checkout of its `inference/` directory; never copied here), `kconvert shard --tp 8`
unquantized and fp8, and `kconvert export --format fp8-block`, each with its defaults and followed by
`sync`, each in its own process (peak RSS and CPU seconds from wait4). A disk floor runs with them:
`dd` of as many bytes as `shard` unquantized writes, from /dev/zero, + `sync` (no reading, no CPU work:
what the disk alone takes). The contenders run round-robin --repeat times (interleaved, so a burst of
load from other jobs hits all of them) and the MEDIAN of each is reported, with the load average at
every run. Prints speed ratios to convert.py, fp8 vs unquantized, export vs shard, and the peak RSS
flatness across sizes.

    .venv/bin/python bench/convert_bench.py --sizes 1GB,3GB --deepseek /path/to/DeepSeek-V3.2-Exp/inference
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _cli import KCONVERT_CMD, fixture, measured  # first: this tree's kconvert and cli on sys.path
from cli.units import fmt_bytes, parse_size


def timed(cmd: list[str], out: Path) -> dict:
    """Wall time (command + sync), CPU seconds and peak RSS of one command in its own process."""
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run(["sync"], check=True)
    load = os.getloadavg()[0]
    t = time.perf_counter()
    r = measured(cmd, stdout=subprocess.DEVNULL)  # the command's own peak RSS, not this process's (bench/_cli.py)
    if r["returncode"] != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{r['stderr'][-2000:]}")
    subprocess.run(["sync"], check=True)
    wall = time.perf_counter() - t
    written = sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) if out.exists() else 0
    shutil.rmtree(out, ignore_errors=True)
    return {"seconds": wall, "cpu": r["cpu"], "peak_rss": r["peak_rss"],
            "written": written, "load": load}


def median_of(runs: list[dict]) -> dict:
    return {"seconds": statistics.median(r["seconds"] for r in runs), "cpu": statistics.median(r["cpu"] for r in runs),
            "peak_rss": statistics.median(r["peak_rss"] for r in runs), "written": runs[-1]["written"],
            "all_seconds": [round(r["seconds"], 2) for r in runs], "loads": [round(r["load"], 1) for r in runs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1GB,3GB")
    ap.add_argument("--workdir", default="/tmp/kbench")
    ap.add_argument("--deepseek", help="DeepSeek-V3 inference/ directory (holds convert.py); skipped when absent")
    ap.add_argument("--repeat", type=int, default=3, help="interleaved rounds (the median is reported)")
    ap.add_argument("--only", help="comma-separated contenders to run (default: all)")
    args = ap.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    from kconvert.source.checkpoint import Checkpoint

    convert_py = Path(args.deepseek) / "convert.py" if args.deepseek else None
    if convert_py is None or not convert_py.exists():
        print(f"DeepSeek's convert.py not given or not found ({convert_py}): its column is skipped "
              f"(pass --deepseek PATH/TO/DeepSeek-V3/inference)")
        convert_py = None
    kc = KCONVERT_CMD  # this tree's CLI, run from its root (measured's cwd)
    results: dict[str, dict[str, dict]] = {}
    for size_text in args.sizes.split(","):
        src = fixture("scale", work / f"scale-{size_text}", size=parse_size(size_text))
        experts = Checkpoint.open(src).config["n_routed_experts"]
        subprocess.run(["cat", *map(str, src.glob("*.safetensors"))], stdout=subprocess.DEVNULL, check=True)
        out = work / "out"
        cmds = {"shard none": kc + ["shard", str(src), str(out), "--tp", "8"],
                "shard fp8": kc + ["shard", str(src), str(out), "--tp", "8", "--quant", "fp8"],
                "export fp8-block": kc + ["export", str(src), str(out), "--format", "fp8-block"]}
        if convert_py:
            cmds = {"convert.py": [sys.executable, str(convert_py), "--hf-ckpt-path", str(src), "--save-path", str(out),
                                   "--n-experts", str(experts), "--model-parallel", "8"], **cmds}
        if args.only:
            cmds = {k: v for k, v in cmds.items() if k in args.only.split(",")}
        runs: dict[str, list[dict]] = {name: [] for name in [*cmds, "dd floor"]}
        for _ in range(args.repeat):
            for name, cmd in cmds.items():
                runs[name].append(timed(cmd, out))
                print(json.dumps({"size": size_text, "cmd": name, **runs[name][-1]}), flush=True)
            floor_bytes = next((r[-1]["written"] for n, r in runs.items() if n == "shard none" and r), 0)
            if floor_bytes:
                dd = ["bash", "-c", f"mkdir -p '{out}' && dd if=/dev/zero of='{out / 'floor'}' bs=64M "
                                    f"count={-(-floor_bytes // (64 << 20))} status=none"]
                runs["dd floor"].append(timed(dd, out) | {"written": floor_bytes})
        results[size_text] = {name: median_of(r) for name, r in runs.items() if r}
    print(f"\nload average now {os.getloadavg()}; {os.cpu_count()} cores; medians of {args.repeat} interleaved rounds")
    for size_text, row in results.items():
        base = row.get("convert.py")
        print(f"\n{size_text}: {'command':<18} {'seconds':>8} {'CPU s':>7} {'peak RSS':>10} {'written':>9} "
              f"{'x convert.py':>12} {'RSS / conv':>10}  runs (load)")
        for name, r in row.items():
            speed = f"{base['seconds'] / r['seconds']:12.2f}" if base else f"{'-':>12}"
            rss = f"{r['peak_rss'] / base['peak_rss']:10.2f}" if base else f"{'-':>10}"
            print(f"{'':>{len(size_text) + 1}} {name:<18} {r['seconds']:8.2f} {r['cpu']:7.2f} {fmt_bytes(r['peak_rss']):>10} "
                  f"{fmt_bytes(r['written']):>9} {speed} {rss}  {r['all_seconds']} ({r['loads']})")
        if "shard none" in row and "shard fp8" in row:
            print(f"  fp8 / unquantized speed: {row['shard none']['seconds'] / row['shard fp8']['seconds']:.2f}")
        if "export fp8-block" in row and "shard fp8" in row:
            print(f"  export / shard (fp8) time: {row['export fp8-block']['seconds'] / row['shard fp8']['seconds']:.2f}")
    sizes = list(results)
    if len(sizes) > 1:
        for name in results[sizes[0]]:
            if name not in ("convert.py", "dd floor") and name in results[sizes[-1]]:
                print(f"peak RSS {sizes[-1]} / {sizes[0]}, {name}: "
                      f"{results[sizes[-1]][name]['peak_rss'] / results[sizes[0]][name]['peak_rss']:.2f}")


if __name__ == "__main__":
    main()
