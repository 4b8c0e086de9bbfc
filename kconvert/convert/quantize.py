"""Target quantizers for `kconvert shard`.

FP8: float8_e4m3fn with one float32 scale per 128x128 block (DeepSeek's `weight_scale_inv`,
dequant = w * scale); with `ue8m0` the scale is rounded up to a power of two (2^ceil(log2(amax/448))),
as DeepSeek-V3.1/V3.2 store it. INT8: symmetric, one float32 scale per output row (amax / 127).
Both refuse non-finite input: a NaN in a source weight is a broken checkpoint, not something to round.
"""

from __future__ import annotations

import math

import torch

from kconvert.errors import CheckpointError
from kconvert.io.dtypes import FP8_BLOCK

FP8_MAX = 448.0  # float8_e4m3fn, no infinities
INT8_MAX = 127.0
TINY = 1e-12  # scale floor for all-zero blocks/rows (keeps dequant exact: 0 * tiny = 0)


def check_finite(x: torch.Tensor, name: str) -> None:
    if x.is_floating_point() and not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).sum())
        raise CheckpointError(f"{bad} NaN/Inf values in the source weight: refusing to quantize it", tensor=name)


def quantize_fp8_block(w: torch.Tensor, block: int = FP8_BLOCK, scale_format: str = "fp32") -> tuple[torch.Tensor, torch.Tensor]:
    """w [R, C] float -> (fp8 [R, C], float32 scale [ceil(R/b), ceil(C/b)]) with w ≈ q * scale."""
    rows, cols = w.shape
    br, bc = math.ceil(rows / block), math.ceil(cols / block)
    x = w.to(torch.float32)
    padded = torch.zeros(br * block, bc * block, dtype=torch.float32)
    padded[:rows, :cols] = x.abs()
    amax = padded.view(br, block, bc, block).amax(dim=(1, 3))
    scale = (amax / FP8_MAX).clamp_min(TINY)
    if scale_format == "ue8m0":
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    del padded
    s = scale.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    q = (x / s).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def quantize_int8_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [R, C] float -> (int8 [R, C], float32 scale [R, 1]) with w ≈ q * scale."""
    x = w.to(torch.float32)
    scale = (x.abs().amax(dim=1, keepdim=True) / INT8_MAX).clamp_min(TINY)
    q = torch.round(x / scale).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize_int8_channel(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.to(torch.float32) * scale.to(torch.float32)).to(dtype)


def quantize_fp8_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [R, C] float -> (float8_e4m3fn [R, C], float32 scale [R, 1]) with w ≈ q * scale (scale = row amax / 448)."""
    x = w.to(torch.float32)
    scale = (x.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(TINY)
    return (x / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale
