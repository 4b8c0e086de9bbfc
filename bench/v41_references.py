"""DeepSeek-V4.1's engine against both MLX references on text-only configs at tiny widths (no Engram, no drafter:
mlx-lm runs them too), in the release's FP8 32 x 32 / MXFP4 storage: mean KLD and same top-1 of the engine in
float32 and in bfloat16 against mlx-vlm (verify's reference, its activation rounding off), of mlx-lm with its
rounding off against mlx-vlm, and of the engine against mlx-lm as it ships (it rounds the window KV to FP8 and the
compressed KV and index queries / keys to FP4 on every forward).

    .venv/bin/python bench/v41_references.py                                   # the three shapes below
    .venv/bin/python bench/v41_references.py --shape plain --set norm_topk_prob=false --set num_experts_per_tok=16

Shapes: `release-like` (kconvert/fixtures/models/dsv41.py RELEASE_LIKE_V41_TEXT, tests/families/dsv41/test_dsv41_forward.py's), `plain`
(its widths, 4 window-only layers, a window of 128 covering the prompt), `release-schedule` (its widths, the
release's 40 layers, ratios, sources, candidate source, window 128, top-512 indexers, 2048 candidate blocks of 8)."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

from _cli import cli  # bench/ is the script's folder: on sys.path
from kconvert.fixtures.models.dsv41 import RELEASE_LIKE_V41_TEXT, v41_config, write_v41_checkpoint

WIDE_WINDOW = {"sliding_window": 128, "index_topk": 512, "candidate_topk_blocks": 2048, "candidate_block_size": 8}
SHAPES = {
    "release-like": RELEASE_LIKE_V41_TEXT,
    "plain": {**RELEASE_LIKE_V41_TEXT, **WIDE_WINDOW, "num_hidden_layers": 4, "compress_ratios": [0] * 4,
              "kv_source_layer_ids": [], "index_source_layer_ids": [], "candidate_source_layer_id": -1},
    "release-schedule": {**RELEASE_LIKE_V41_TEXT, **WIDE_WINDOW, "num_hidden_layers": 40,
                         "compress_ratios": [0, 0] + [2] * 18 + [1] * 20, "kv_source_layer_ids": [2, 8, 14, 20],
                         "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36], "candidate_source_layer_id": 20},
}


def kld(p: torch.Tensor, q: torch.Tensor) -> str:
    lp, lq = torch.log_softmax(p.double(), -1), torch.log_softmax(q.double(), -1)
    same = float((p.argmax(-1) == q.argmax(-1)).double().mean()) * 100
    return f"{float((lp.exp() * (lp - lq)).sum(-1).mean()):.2e} ({same:.1f} %)"


def main() -> None:
    from engine.model import Model
    from kconvert.verify.mlx_reference import MlxDeepseekV41, MlxLmDeepseekV41

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", action="append", choices=list(SHAPES), help="default: all")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON", help="a text_config override")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=100)
    ap.add_argument("--workdir", default="/tmp/kv41-refs")
    args = ap.parse_args()
    extra = {k: json.loads(v) for k, v in (s.split("=", 1) for s in args.set)}
    print("| shape | engine fp32 vs mlx-vlm | mlx-lm (rounding off) vs mlx-vlm | engine fp32 vs mlx-lm as shipped "
          "| engine bf16 vs mlx-vlm |\n|---|---|---|---|---|")
    for shape in args.shape or list(SHAPES):
        work = Path(args.workdir) / shape
        shutil.rmtree(work, ignore_errors=True)
        config = v41_config({**SHAPES[shape], **extra})
        write_v41_checkpoint(work / "src", config, seed=args.seed)
        r = cli("shard", work / "src", work / "tp1", "--tp", 1, "--quant", "none")
        assert r.returncode == 0, r.stderr
        high = min(config["image_token_id"], config["text_config"]["bos_token_id"])  # text tokens only
        ids = torch.randint(2, high, (1, args.tokens), generator=torch.Generator().manual_seed(args.seed))
        e32, e16 = (Model.from_converted(work / "tp1", dtype=d).forward(ids).float() for d in (torch.float32, torch.bfloat16))
        vlm = MlxDeepseekV41(work / "src", torch.float32)(ids).logits
        lm_off, lm_on = (MlxLmDeepseekV41(work / "src", rounding=b)(ids) for b in (False, True))
        print(f"| {shape} {' '.join(args.set)} | {kld(vlm, e32)} | {kld(vlm, lm_off)} | {kld(lm_on, e32)} "
              f"| {kld(vlm, e16)} |", flush=True)


if __name__ == "__main__":
    main()
