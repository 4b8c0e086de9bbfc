"""Transcode throughput: `shard --tp 8 --quant Q` in GB/s of source, with `--workers 1` and 2 and under torchrun with 1
and 2 processes (each `--workers 1`), so the per-core rate and the scaling with threads and processes are read off
one table (bench only, not CI; issue 57).

The time is shard's own (its `--json` `seconds`: from the plan's end to kconvert.json; the CLI's start-up, mostly
importing torch, is apart and printed beside it); the source is in the page cache. Sources, built once into --work:
a `scale` bf16 checkpoint of --size (fp8, int8, int4, nvfp4 from BF16) and DeepSeek-V4 in V4-Flash's storage (FP8
linears + MXFP4 experts: `--quant fp8` re-encodes the MXFP4 experts as FP8 exactly, `--quant nvfp4` casts them
exactly, `--quant fp4` copies them; bench/phases_bench.py builds it). At N cores, a transcode bound by the cores
runs at N x the per-core rate until the disk's rate caps it: min(N x per core, disk).

    .venv/bin/python bench/transcode_bench.py --size 1GB --work /tmp/kphases
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from _cli import KCONVERT_CMD, ROOT, fixture, measured  # first: this tree's kconvert on sys.path

ROWS = (("bf16", "fp8"), ("bf16", "int8"), ("bf16", "int4"), ("bf16", "nvfp4"),
        ("mxfp4", "fp8"), ("mxfp4", "nvfp4"), ("mxfp4", "fp4"), ("mxfp4", "none"), ("bf16", "none"))


def run(cmd: list, out: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    r = measured(cmd)
    if r["returncode"]:
        raise SystemExit(f"failed: {' '.join(map(str, cmd))}\n{r['stderr'][-3000:]}")
    rep = json.loads(r["stdout"][r["stdout"].index("{"):])
    return {"seconds": rep["seconds"], "wall": r["wall"], "cpu": r["cpu"], "rss": r["peak_rss"],
            "bytes_in": rep["bytes_in"], "bytes_out": rep["bytes_out"], "load": os.getloadavg()[0]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1GB", help="bf16 source size (the scale preset); the MXFP4 source ~1/8 of it")
    ap.add_argument("--work", default="/tmp/kphases")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--only", help="comma-separated source:quant rows (default: all)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    from cli.units import parse_size
    from phases_bench import mxfp4_source

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    size = parse_size(a.size)
    srcs = {"bf16": fixture("scale", work / f"scale-{a.size}", size=size), "mxfp4": mxfp4_source(work, size // 8)}
    torchrun = Path(sys.executable).with_name("torchrun")
    rows = [r for r in ROWS if not a.only or f"{r[0]}:{r[1]}" in a.only.split(",")]
    out, report = work / "transcode-out", {}
    for kind, quant in rows:
        src = srcs[kind]
        subprocess.run(["cat", *map(str, src.glob("*.safetensors"))], stdout=subprocess.DEVNULL, check=True)
        shard = ["shard", src, out, "--tp", a.tp, "--quant", quant, "--json"]
        res = {f"workers {w}": run([*KCONVERT_CMD, *shard, "--workers", w], out) for w in (1, 2)}
        for p in (1, 2):
            res[f"torchrun {p}"] = run([torchrun, "--nproc-per-node", p, "--master-port", "29561", "-m", "cli.main",
                                        *shard, "--workers", 1], out)
        res["source_bytes"] = sum(f.stat().st_size for f in src.glob("*.safetensors"))  # "GB/s of source": on disk
        report[f"{kind}:{quant}"] = res
        print(json.dumps({f"{kind}:{quant}": res}), flush=True)
    shutil.rmtree(out, ignore_errors=True)
    print(f"\n| source -> --quant (tp {a.tp}) | source GB | workers 1: s, GB/s | workers 2: s, GB/s (x) | torchrun 1: "
          "GB/s | torchrun 2: GB/s (x) | start-up s | load avg |\n|---|---|---|---|---|---|---|---|")
    for key, res in report.items():
        gb = res["source_bytes"] / 1e9
        res = {k: v for k, v in res.items() if k != "source_bytes"}
        rate = {k: gb / v["seconds"] for k, v in res.items()}
        w1 = res["workers 1"]
        print(f"| {key.replace(':', ' -> ')} | {gb:.2f} | {w1['seconds']:.2f}, {rate['workers 1']:.2f} | "
              f"{res['workers 2']['seconds']:.2f}, {rate['workers 2']:.2f} ({rate['workers 2'] / rate['workers 1']:.2f}x) | "
              f"{rate['torchrun 1']:.2f} | {rate['torchrun 2']:.2f} ({rate['torchrun 2'] / rate['torchrun 1']:.2f}x) | "
              f"{w1['wall'] - w1['seconds']:.2f} | {max(v['load'] for v in res.values()):.1f} |")
    if a.json:
        a.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    os.chdir(ROOT)
    raise SystemExit(main())
