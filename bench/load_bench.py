"""Time-to-ready of one rank, side by side in one run (page cache warm: this machine cannot drop it).

Contenders on the same converted files (tp 1, --quant none):
  kconvert   kconvert.load.loader stream to cpu, every tensor kept (what an engine holds)
  st+copy    safetensors.torch.load_file per file + copy into preallocated tensors (= load_state_dict)
  cat        `cat FILES > /dev/null`: the raw read limit
and, on the source checkpoint, transformers `from_pretrained` (bf16) where the model is small enough.
Each contender runs in its own process; peak RSS is that process's.

    .venv/bin/python bench/load_bench.py --presets small-k25-dsv32,scale:2GB --workdir /tmp/kload
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from _cli import conversion, fixture, measured  # first: this tree's kconvert on sys.path

KCONVERT = """
import json, sys, time
from kconvert.load.loader import open_converted
t = time.perf_counter(); conv = open_converted(sys.argv[1]); held = dict(conv.stream("cpu", prefetch=2))
print(json.dumps({"s": time.perf_counter() - t}))
"""
ST_COPY = """
import json, sys, time, torch
from pathlib import Path
from safetensors import safe_open
from safetensors.torch import load_file
files = sorted(Path(sys.argv[1]).glob("rank-000/*.safetensors"))
params = {}
for f in files:  # the "model": parameters allocated up front, as load_state_dict expects
    with safe_open(f, "pt") as h:
        for k in h.keys():
            s = h.get_slice(k); params[k] = torch.empty(s.get_shape(), dtype=getattr(torch, {"BF16": "bfloat16", "F32": "float32", "F8_E4M3": "float8_e4m3fn", "I8": "int8"}[s.get_dtype()]))
t = time.perf_counter()
for f in files:
    for k, v in load_file(f).items():
        params[k].copy_(v)
print(json.dumps({"s": time.perf_counter() - t}))
"""
HF = """
import json, sys, time, torch, transformers
cfg = json.load(open(sys.argv[1] + "/config.json"))
cls = getattr(transformers, cfg["architectures"][0])
t = time.perf_counter(); m = cls.from_pretrained(sys.argv[1], dtype=torch.bfloat16)
print(json.dumps({"s": time.perf_counter() - t}))
"""


def run(code: str, arg: str) -> dict:
    """One contender in its own process: its timed seconds, and its own peak RSS (bench/_cli.measured: not this
    process's, which built the fixtures)."""
    r = measured([sys.executable, "-c", code, arg])
    if r["returncode"]:
        raise RuntimeError(r["stderr"][-2000:])
    return {**json.loads(r["stdout"].strip().splitlines()[-1]), "rss": r["peak_rss"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="small-k25-dsv32,scale:2GB")
    ap.add_argument("--workdir", default="/tmp/kload")
    ap.add_argument("--repeat", type=int, default=2, help="best of N for each contender")
    args = ap.parse_args()
    from cli.units import fmt_bytes, parse_size

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for spec in args.presets.split(","):
        preset, _, size = spec.partition(":")
        src = fixture(preset, work / spec.replace(":", "-"), size=parse_size(size) if size else None)
        out = conversion(src, work / (src.name + "-tp1"), quant="none", overwrite=True)
        files = sorted(out.glob("rank-000/*.safetensors"))
        nbytes = sum(f.stat().st_size for f in files)
        subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)  # warm the cache
        res = {}
        for name, code, arg in (("kconvert", KCONVERT, str(out)), ("st+copy", ST_COPY, str(out))):
            res[name] = min((run(code, arg) for _ in range(args.repeat)), key=lambda r: r["s"])
        t = time.perf_counter()
        for _ in range(args.repeat):
            subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)
        res["cat"] = {"s": (time.perf_counter() - t) / args.repeat, "rss": 0}
        if preset != "scale":
            res["transformers"] = run(HF, str(src))
        row = {"preset": spec, "bytes": nbytes, **{k: v for k, v in res.items()}}
        rows.append(row)
        print(json.dumps(row))
    print(f"\n{'preset':>12} {'bytes':>9} {'kconvert s':>10} {'GB/s':>6} {'x st+copy':>9} {'x cat':>6} {'x HF':>6} {'RSS k / st':>20}")
    for r in rows:
        k = r["kconvert"]["s"]
        hf = f"{r['transformers']['s'] / k:6.1f}" if "transformers" in r else "     -"
        print(f"{r['preset']:>12} {fmt_bytes(r['bytes']):>9} {k:10.3f} {r['bytes'] / k / 1e9:6.2f} "
              f"{r['st+copy']['s'] / k:9.2f} {r['cat']['s'] / k:6.2f} {hf} "
              f"{fmt_bytes(r['kconvert']['rss']):>9} / {fmt_bytes(r['st+copy']['rss'])}")


if __name__ == "__main__":
    main()
