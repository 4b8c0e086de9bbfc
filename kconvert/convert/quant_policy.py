"""Which tensors a conversion quantizes, and what they cost stored.

Schemes: `none` (bf16; fp32 tensors such as e_score_correction_bias stay fp32), `fp8` (e4m3fn +
float32 scale per 128x128 block, DeepSeek naming `weight_scale_inv`), `int8` (symmetric per output
channel, `weight_scale` [out, 1]). The manifest's `quantize` flag is the default; `--keep PATTERN`
and `--quantize PATTERN` (fnmatch globs on tensor names) override it, keep winning over quantize.
Only 2-D weights are ever quantized.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass

from kconvert.errors import UsageError
from kconvert.family.manifest import TensorInfo
from kconvert.io.dtypes import FP8_BLOCK

SCHEMES = ("none", "fp8", "int8")
SCALE_FORMATS = ("fp32", "ue8m0")


@dataclass(frozen=True)
class QuantPolicy:
    scheme: str = "none"
    keep: tuple[str, ...] = ()
    force: tuple[str, ...] = ()
    scale_format: str = "fp32"

    def __post_init__(self):
        if self.scheme not in SCHEMES:
            raise UsageError(f"unknown --quant {self.scheme!r} (choose from {', '.join(SCHEMES)})")
        if self.scale_format not in SCALE_FORMATS:
            raise UsageError(f"unknown --scale-format {self.scale_format!r} (choose from {', '.join(SCALE_FORMATS)})")

    def quantizes(self, info: TensorInfo, shape: tuple[int, ...]) -> bool:
        if self.scheme == "none" or len(shape) != 2:
            return False
        if any(fnmatch.fnmatchcase(info.name, p) for p in self.keep):
            return False
        if any(fnmatch.fnmatchcase(info.name, p) for p in self.force):
            return True
        return info.quantize

    def stored_bytes(self, info: TensorInfo, shape: tuple[int, ...], src_itemsize: int = 2) -> int:
        """Bytes this tensor takes in the converted checkpoint, scales included."""
        n = math.prod(shape)
        if not self.quantizes(info, shape):
            return n * (4 if src_itemsize == 4 else 2)
        if self.scheme == "fp8":
            return n + 4 * math.ceil(shape[0] / FP8_BLOCK) * math.ceil(shape[1] / FP8_BLOCK)
        return n + 4 * shape[0]  # int8: one float32 scale per output row
