"""`fp8_channel`: float8_e4m3fn, one float32 scale per output row (`X.weight`, `X.weight_scale` [R, 1]):
s = max(row amax / 448, 1e-12), q = e4m3(w / s), dequant = q * s. Export's `fp8-channel` (compressed-
tensors float-quantized). Not offered by `shard`: the engine has no per-channel FP8 path."""

from __future__ import annotations

from kconvert.quant.chunks import FP8_MAX, RowScaled, quantize_rows


def quantize_fp8_channel(w: torch.Tensor, name: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """w [R, C] float -> (float8_e4m3fn [R, C], float32 scale [R, 1]) with w ≈ q * scale (scale = row amax / 448)."""
    import torch

    return quantize_rows(w, FP8_MAX, torch.float8_e4m3fn, False, name)


class Fp8Channel(RowScaled):
    name, tag, limit, rounded = "fp8_channel", "F8_E4M3", FP8_MAX, False
    shard = False


SCHEME = Fp8Channel()
