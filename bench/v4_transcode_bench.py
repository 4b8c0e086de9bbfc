"""DeepSeek-V4's FP4 experts on GPUs without FP4: `shard --quant fp8` of the release storage (FP8 dense linears
copied, FP4 experts re-encoded as FP8 exactly) next to a plain FP8 shard of the same weights in bf16 (every
weight quantized: what a tool without the transcode does), `--quant fp4` (the experts' bytes copied) and
`--quant none` (dequantized to bf16), side by side in one run, medians of --runs.

The sources: transformers' DeepseekV4ForCausalLM at the widths below (tiny-dsv4's schedule: sliding / CSA /
HCA layers, mHC, hash + top-k MoE), written in V4-Flash's storage (FP8 + e8m0 `.scale`, FP4 experts) and as
its bf16 twin (the same values, dequantized).

    .venv/bin/python bench/v4_transcode_bench.py --workdir /tmp/kv4bench
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from pathlib import Path

from _cli import timed_shard  # first: this tree's kconvert on sys.path (bench/ is the script's folder)

WIDTHS = {"hidden_size": 512, "moe_intermediate_size": 512, "n_routed_experts": 32, "q_lora_rank": 256,
          "o_lora_rank": 128, "num_attention_heads": 8, "head_dim": 128}


def build(work: Path) -> tuple[Path, Path]:
    import torch

    from kconvert.fixtures.models.dsv4 import build_v4_model, write_v4_model
    from kconvert.fixtures.storage.shards import write_tensors
    from kconvert.source.checkpoint import Checkpoint

    flash, twin = work / "v4-flash", work / "v4-bf16"
    if not (flash / "config.json").exists():
        shutil.rmtree(flash, ignore_errors=True)
        flash.mkdir(parents=True)
        write_v4_model(build_v4_model(0, WIDTHS), flash, 0, "flash")
    if not (twin / "config.json").exists():  # the release's values, dequantized exactly, stored as bf16
        shutil.rmtree(twin, ignore_errors=True)
        twin.mkdir(parents=True)
        ck = Checkpoint.open(flash)
        tensors = {n: (ck.read(n).to(torch.bfloat16) if t.format != "plain" else ck.read(n)) for n, t in ck.logical.items()}
        write_tensors(twin, tensors, sorted(tensors), 3)
        cfg = json.loads((flash / "config.json").read_text())
        cfg.pop("quantization_config", None)
        cfg.pop("expert_dtype", None)
        (twin / "config.json").write_text(json.dumps(cfg, indent=2))
        for f in flash.iterdir():
            if f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
                shutil.copy(f, twin / f.name)
    return flash, twin


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="/tmp/kv4bench")
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    flash, twin = build(work)
    rows = [("release storage --quant fp8 (FP4 experts re-encoded)", flash, "fp8"),
            ("bf16 twin --quant fp8 (every weight quantized)", twin, "fp8"),
            ("release storage --quant fp4 (FP4 experts copied)", flash, "fp4"),
            ("release storage --quant none (dequantized to bf16)", flash, "none")]
    out = {}
    for label, src, quant in rows:
        runs = [timed_shard(src, work / "out", "--tp", 1, "--quant", quant) for _ in range(a.runs)]
        out[label] = {"wall_s": statistics.median(r["wall"] for r in runs),
                      "seconds": statistics.median(r.get("seconds", r["wall"]) for r in runs),
                      "bytes_written": runs[0].get("bytes_out")}
        print(json.dumps({label: out[label]}), flush=True)
    base = out[rows[1][0]]["seconds"]
    print("\n| conversion (tp 1) | shard's run s (median) | vs plain fp8 | wall s with start-up | written |\n"
          "|---|---|---|---|---|")
    for label, _, _ in rows:
        r = out[label]
        print(f"| {label} | {r['seconds']:.2f} | {r['seconds'] / base:.2f}x | {r['wall_s']:.2f} | "
              f"{(r['bytes_written'] or 0) / 1e6:.0f} MB |")


if __name__ == "__main__":
    main()
