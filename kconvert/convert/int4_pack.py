"""INT4 in the compressed-tensors `pack-quantized` layout (Kimi-K2-Thinking / K2.5 routed experts).

Symmetric, one scale per `group` input columns, compressed-tensors' min-max rule: scale = amax / 7.5
(the half-range of [-8, 7]), q = clamp(round(w / scale), -8, 7), stored as nibble q + 8, eight to an
int32 word, low nibble first. The scale is stored in bf16, so q is computed with the bf16-rounded scale
(what a reader multiplies by). dequant = (nibble - 8) * scale.

Kept apart from quantize.py until the int4 of `shard --quant int4` (which packs two nibbles a byte with
float32 scales) and this one share a core.
"""

from __future__ import annotations

import torch

from kconvert.errors import CheckpointError

INT4_HALF_RANGE = 7.5  # (7 - (-8)) / 2


def quantize_int4_packed(w: torch.Tensor, group: int = 32, name: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """w [R, C] float -> (int32 [R, C/8] packed, bf16 scale [R, C/group])."""
    rows, cols = w.shape
    if cols % group or cols % 8:
        raise CheckpointError(f"in_features {cols} is not a multiple of the group size {group} (and of 8)", tensor=name)
    g = w.to(torch.float32).view(rows, cols // group, group)
    scale = (g.abs().amax(dim=-1) / INT4_HALF_RANGE).to(torch.bfloat16)
    scale = torch.where(scale > 0, scale, torch.full_like(scale, 1e-12))  # all-zero group: 0 * tiny = 0
    q = torch.round(g / scale.to(torch.float32)[..., None]).clamp_(-8, 7).to(torch.int64) + 8
    words = (q.view(rows, cols // 8, 8) << (torch.arange(8, dtype=torch.int64) * 4)).sum(dim=-1)
    words = torch.where(words >= 2**31, words - 2**32, words)  # the same 32 bits, as a signed int32
    return words.to(torch.int32), scale.contiguous()
