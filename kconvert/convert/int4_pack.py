"""INT4 in the compressed-tensors `pack-quantized` layout (Kimi-K2-Thinking / K2.5 routed experts).

Symmetric, one scale per `group` input columns, compressed-tensors' min-max rule: scale = amax / 7.5
(the half-range of [-8, 7]), q = clamp(round(w / scale), -8, 7), stored as nibble q + 8, eight to an
int32 word, low nibble first. The scale is stored in bf16, so q is computed with the bf16-rounded scale
(what a reader multiplies by). dequant = (nibble - 8) * scale.

The group quantizer is quantize.int4_group_codes (the one `shard --quant int4` uses, with other rule
parameters); this module is only the packer.
"""

from __future__ import annotations

import torch

from kconvert.errors import CheckpointError
from kconvert.convert.quantize import int4_group_codes

INT4_HALF_RANGE = 7.5  # (7 - (-8)) / 2
_SHIFTS = torch.arange(8, dtype=torch.int64) * 4
_ROWS_PER_STEP = 256


def pack_int32(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes -8..7 [R, C] -> int32 [R, C/8]: nibble q + 8, eight per word, low nibble first."""
    rows, cols = codes.shape
    out = torch.empty(rows, cols // 8, dtype=torch.int32)
    for r0 in range(0, rows, _ROWS_PER_STEP):  # int64 temporaries of a few rows at a time
        c = codes[r0:r0 + _ROWS_PER_STEP]
        words = ((c.to(torch.int64) + 8).view(c.shape[0], cols // 8, 8) << _SHIFTS).sum(dim=-1)
        out[r0:r0 + _ROWS_PER_STEP] = torch.where(words >= 2**31, words - 2**32, words)  # same 32 bits, signed
    return out


def quantize_int4_packed(w: torch.Tensor, group: int = 32, name: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """w [R, C] float -> (int32 [R, C/8] packed, bf16 scale [R, C/group])."""
    rows, cols = w.shape
    if cols % group or cols % 8:
        raise CheckpointError(f"in_features {cols} is not a multiple of the group size {group} (and of 8)", tensor=name)
    codes, scale = int4_group_codes(w, group, INT4_HALF_RANGE, "amax", torch.bfloat16, name, floor_zeros_only=True)
    return pack_int32(codes), scale
