"""Round to nearest, the clipping search and GPTQ (`--calibrate`) side by side: `kconvert shard --quant int4`
of one trained fixture, each verified against the same unquantized reference (verify's cost figures: mean
and p99 KLD, same top-1) and against its own faithfulness reference; the shard's time and peak RSS (each
shard in its own process, one at a time), and the calibrated run's per-layer figures.

    .venv/bin/python bench/calibration_bench.py --preset tiny-k25-dsv32-trained --tp 2 --workdir /tmp/kcalib
    .venv/bin/python bench/calibration_bench.py --preset tiny-dsv4-trained --tp 2 --methods 1,2 --workdir /tmp/kcalib-v4
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

from _cli import cli, timed_shard  # bench/ is the script's folder: on sys.path
METHODS = {"round to nearest (amax)": ["--int4-scales", "amax"],
           "clipping search (default)": [],
           "GPTQ (--calibrate stdlib)": ["--calibrate", "stdlib"],
           "GPTQ, amax scales": ["--calibrate", "stdlib", "--int4-scales", "amax"],
           "GPTQ, Kimi 15-level grid": ["--calibrate", "stdlib", "--calibration-grid", "kimi"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny-k25-dsv32-trained")
    ap.add_argument("--src", help="an existing checkpoint instead of building --preset")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64 * 256, help="--calibration-tokens")
    ap.add_argument("--seq", type=int, default=256, help="--calibration-seq")
    ap.add_argument("--methods", default=",".join(str(i) for i in range(len(METHODS))), help="indices into METHODS")
    ap.add_argument("--workdir", default="/tmp/kcalib")
    ap.add_argument("--shard-args", default="", help="more shard options for every method (e.g. \"--keep '*layers.0.*'\")")
    args = ap.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    src = Path(args.src) if args.src else work / args.preset
    if not (src / "config.json").exists():
        r = cli("fixture", args.preset, src)
        assert r.returncode == 0, r.stderr
    ref = work / f"ref-{src.name}.safetensors"
    if not ref.exists():
        r = cli("reference", src, "--out", ref)
        assert r.returncode == 0, r.stderr
    rows = []
    for i in map(int, args.methods.split(",")):
        label, extra = list(METHODS.items())[i]
        if "--calibrate" in extra:
            extra = extra + ["--calibration-tokens", args.tokens, "--calibration-seq", args.seq]
        extra = extra + shlex.split(args.shard_args)
        out = work / f"out-{src.name}-{i}"
        run = timed_shard(src, out, "--tp", args.tp, "--quant", "int4", *extra)
        secs = run["wall"]
        r = cli("verify", out, "--reference", ref, "--json")
        rep = json.loads(r.stdout)
        rows.append((label, rep, secs, run))
        print(json.dumps({"method": label, "verdict": rep["verdict"], "shard_s": round(secs, 1),
                          "peak_rss": run.get("peak_rss_bytes"), "cost": rep["cost"]["overall"],
                          "mean_kld_by_kind": {k: v["mean_kld"] for k, v in rep["cost"].get("by_kind", {}).items()},
                          "faithful_mean_kld": rep["faithfulness"]["overall"].get("mean_kld"),
                          "calibration": run.get("calibration", {}).get("layers")}), flush=True)
    base = next((rep["cost"]["overall"]["mean_kld"] for label, rep, _, _ in rows if "default" in label), None)
    print(f"\n{src.name}, tp {args.tp}, group 32; GPTQ: {args.tokens} tokens in sequences of {args.seq}; "
          f"shard options {args.shard_args or '(none)'}\n")
    print("| method | mean KLD | × clipping search | p99 KLD | same top-1 | faithful | shard s | peak RSS |\n"
          "|---|---|---|---|---|---|---|---|")
    for label, rep, secs, run in rows:
        c = rep["cost"]["overall"]
        ratio = f"{base / c['mean_kld']:.2f}" if base else "–"
        print(f"| {label} | {c['mean_kld']:.2e} | {ratio} | {c['p99_kld']:.2e} | {c['same_top1_pct']:.2f} % | "
              f"{rep['faithfulness']['verdict']} | {secs:.1f} | {run['peak_rss_bytes'] / 2**20:.0f} MiB |")


if __name__ == "__main__":
    main()
