"""`int8`: symmetric int8, one float32 scale per output row (`X.weight` I8, `X.weight_scale` [R, 1]):
s = max(row amax / 127, 1e-12), q = clamp(round(w / s), ±127), dequant = q * s.
Export's `w8a8-int8` stores this scheme's values under the same names."""

from __future__ import annotations

import torch

from kconvert.quant.chunks import INT8_MAX, quantize_rows
from kconvert.quant.scheme import Options, Scheme, Spec


def quantize_int8_channel(w: torch.Tensor, name: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """w [R, C] float -> (int8 [R, C], float32 scale [R, 1]) with w ≈ q * scale."""
    return quantize_rows(w, INT8_MAX, torch.int8, True, name)


class Int8Channel(Scheme):
    name = "int8"

    def specs(self, src: str, shape: tuple[int, ...], opts: Options) -> list[Spec]:
        return [(src, "I8", tuple(shape)), (src + "_scale", "F32", (shape[0], 1))]

    def quantize(self, w: torch.Tensor, opts: Options, name: str = "") -> list[torch.Tensor]:
        return list(quantize_int8_channel(w, name))

    def dequantize(self, stored: list[torch.Tensor], opts: Options, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return stored[0].to(dtype) * stored[1].to(dtype)


SCHEME = Int8Channel()
