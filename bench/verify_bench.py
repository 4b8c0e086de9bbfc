"""verify's two figures for none / fp8 / fp8-ue8m0 / int8 / int4 (clipping-search and amax scales, GPTQ) / fp4
conversions of one preset at tp 1 and tp 2: the cost (vs the unquantized reference: mean and p99 KLD,
same top-1, PPL ratio) and the faithfulness (mean KLD vs the source fake-quantized the same way).

    .venv/bin/python bench/verify_bench.py --preset tiny-k25-dsv32-trained --tp 1,2 --workdir /tmp/kverify
    .venv/bin/python bench/verify_bench.py --preset tiny-kimi-k3-trained --tp 2 --schemes none,fp4,fp8,int8,int4,int4-gptq \
        --workdir /tmp/kverify-k3                  # Kimi K3 against mlx-lm (training it takes ~20 min, once)
    .venv/bin/python bench/verify_bench.py --preset tiny-dsv4-trained --tp 1 --shard-args=--no-draft-heads \
        --schemes fp4,nvfp4-experts,nvfp4,int4,int4-gptq --workdir /tmp/kverify-v4   # NVFP4 beside MXFP4 / INT4
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from _cli import cli  # bench/ is the script's folder: on sys.path
SCHEMES = {"none": ["--quant", "none"], "fp8": ["--quant", "fp8"],
           "fp8-ue8m0": ["--quant", "fp8", "--scale-format", "ue8m0"], "int8": ["--quant", "int8"],
           "int4": ["--quant", "int4"], "int4-amax": ["--quant", "int4", "--int4-scales", "amax"], "fp4": ["--quant", "fp4"],
           "int4-gptq": ["--quant", "int4", "--calibrate", "stdlib"],  # GPTQ on the default calibration set
           "nvfp4": ["--quant", "nvfp4"],  # NVFP4 experts + the family's recipe for the rest (block FP8 attention)
           # NVFP4 on the routed experts alone (the rest kept, as fp4 / int4 keep it): the like-for-like row
           "nvfp4-experts": ["--quant", "nvfp4", "--keep", "*attn*", "--keep", "*shared_experts*", "--keep", "mtp.*"],
           # GPTQ NVFP4 (the same scales, codes calibrated on the default set): beside each row above
           "nvfp4-gptq": ["--quant", "nvfp4", "--calibrate", "stdlib"],
           "nvfp4-experts-gptq": ["--quant", "nvfp4", "--keep", "*attn*", "--keep", "*shared_experts*", "--keep", "mtp.*",
                                  "--calibrate", "stdlib"],
           # from BF16 where a release's experts are MXFP4 already (Kimi K3): the experts exact either way, the BF16
           # shared experts and latent projections quantized to NVFP4 or to MXFP4
           "nvfp4-shared": ["--quant", "nvfp4", "--keep", "*self_attn*", "--quantize", "*shared_experts*",
                            "--quantize", "*routed_expert_*_proj*"],
           "fp4-shared": ["--quant", "fp4", "--quantize", "*shared_experts*", "--quantize", "*routed_expert_*_proj*"],
           # the same with GPTQ on what it puts in NVFP4 (K3's MXFP4 experts are cast exactly either way)
           "nvfp4-shared-gptq": ["--quant", "nvfp4", "--keep", "*self_attn*", "--quantize", "*shared_experts*",
                                 "--quantize", "*routed_expert_*_proj*", "--calibrate", "stdlib"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny-k25-dsv32-trained")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tp", default="1,2", help="comma-separated tp degrees")
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--workdir", default="/tmp/kverify")
    ap.add_argument("--shard-args", default="", help="more `shard` arguments, space-separated (--no-draft-heads)")
    args = ap.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    src = work / f"{args.preset}-s{args.seed}"
    if not (src / "config.json").exists():
        shutil.rmtree(src, ignore_errors=True)
        r = cli("fixture", args.preset, src, "--seed", args.seed)
        assert r.returncode == 0, r.stderr
        print(r.stdout.strip())
    ref = work / f"ref-s{args.seed}.safetensors"  # the same file bench/verify_damage.py makes
    t = time.perf_counter()
    if not ref.exists():
        r = cli("reference", src, "--out", ref, "--hidden-states")
        assert r.returncode == 0, r.stderr
    print(f"reference: {time.perf_counter() - t:.1f} s")
    rows = []
    for tp in map(int, args.tp.split(",")):
        for label in args.schemes.split(","):
            out = work / f"{src.name}-tp{tp}-{label}"
            shutil.rmtree(out, ignore_errors=True)
            r = cli("shard", src, out, "--tp", tp, *SCHEMES[label], *args.shard_args.split())
            assert r.returncode == 0, r.stderr
            t = time.perf_counter()
            r = cli("verify", out, "--reference", ref, "--json")
            secs = time.perf_counter() - t
            if not r.stdout.strip():
                raise SystemExit(f"verify {out} gave no report ({r.returncode}):\n{r.stderr}")
            rep = json.loads(r.stdout)
            rows.append((tp, label, rep, secs))
            print(json.dumps({"tp": tp, "scheme": label, "verdict": rep["verdict"], "seconds": round(secs, 1),
                              "faithful_mean_kld": rep["faithfulness"]["overall"].get("mean_kld"),
                              "cost": rep["cost"]["overall"], "failures": rep["failures"]}), flush=True)
    print("\n| tp | scheme | verdict | faithful mean KLD | cost mean KLD | p99 KLD | same top-1 | PPL ratio "
          "| worst kind (mean KLD) | verify s |\n|---|---|---|---|---|---|---|---|---|---|")
    for tp, label, rep, secs in rows:
        c, f = rep["cost"]["overall"], rep["faithfulness"]["overall"]
        kind, worst = max(rep["cost"]["by_kind"].items(), key=lambda kv: kv[1]["mean_kld"])
        print(f"| {tp} | {label} | {rep['verdict']} | {f.get('mean_kld', float('nan')):.1e} | {c['mean_kld']:.2e} | "
              f"{c['p99_kld']:.3f} | {c['same_top1_pct']:.2f} % | {c['ppl_ratio']:.4f} | {kind} {worst['mean_kld']:.2e} "
              f"| {secs:.0f} |")


if __name__ == "__main__":
    main()
