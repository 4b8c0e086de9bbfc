"""The verify table for none / fp8 / fp8-ue8m0 / int8 conversions of one preset, and how long verify takes.

    .venv/bin/python bench/verify_bench.py --preset small-k3 --tp 2 --workdir /tmp/kverify
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli.main", *map(str, args)], cwd=ROOT, capture_output=True, text=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small-k3")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--workdir", default="/tmp/kverify")
    args = ap.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    src = work / args.preset
    if not (src / "config.json").exists():
        shutil.rmtree(src, ignore_errors=True)
        r = cli("fixture", args.preset, src)
        assert r.returncode == 0, r.stderr
    ref = work / f"{args.preset}-ref.safetensors"
    t = time.perf_counter()
    if not ref.exists():
        r = cli("reference", src, "--out", ref)
        assert r.returncode == 0, r.stderr
    print(f"reference: {time.perf_counter() - t:.1f} s")
    rows = []
    for label, extra in (("none", ["--quant", "none"]), ("fp8", ["--quant", "fp8"]),
                         ("fp8-ue8m0", ["--quant", "fp8", "--scale-format", "ue8m0"]), ("int8", ["--quant", "int8"])):
        out = work / f"{args.preset}-tp{args.tp}-{label}"
        shutil.rmtree(out, ignore_errors=True)
        r = cli("shard", src, out, "--tp", args.tp, *extra)
        assert r.returncode == 0, r.stderr
        t = time.perf_counter()
        r = cli("verify", out, "--reference", ref, "--json")
        secs = time.perf_counter() - t
        rep = json.loads(r.stdout)
        rows.append((label, rep, secs))
        print(json.dumps({"scheme": label, "verdict": rep["verdict"], "seconds": secs, **rep["overall"]}))
    print(f"\n{'scheme':>10} {'verdict':>7} {'mean KLD':>10} {'median':>10} {'p99':>8} {'max':>7} {'top-1':>7} "
          f"{'RMS dp':>7} {'PPL x':>7} {'verify s':>8}")
    for label, rep, secs in rows:
        o = rep["overall"]
        print(f"{label:>10} {rep['verdict']:>7} {o['mean_kld']:10.6f} {o['median_kld']:10.6f} {o['p99_kld']:8.4f} "
              f"{o['max_kld']:7.3f} {o['same_top1_pct']:6.2f}% {o['rms_dp_pct']:6.3f}% {o['ppl_ratio']:7.4f} {secs:8.1f}")


if __name__ == "__main__":
    main()
