"""`int8`: symmetric int8, one float32 scale per output row (`X.weight` I8, `X.weight_scale` [R, 1]):
s = max(row amax / 127, 1e-12), q = clamp(round(w / s), ±127), dequant = q * s.
Export's `w8a8-int8` stores this scheme's values under the same names."""

from __future__ import annotations

from kconvert.quant.chunks import INT8_MAX, RowScaled, quantize_rows


def quantize_int8_channel(w: torch.Tensor, name: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """w [R, C] float -> (int8 [R, C], float32 scale [R, 1]) with w ≈ q * scale."""
    import torch

    return quantize_rows(w, INT8_MAX, torch.int8, True, name)


class Int8Channel(RowScaled):
    name, tag, limit, rounded = "int8", "I8", INT8_MAX, True


SCHEME = Int8Channel()
