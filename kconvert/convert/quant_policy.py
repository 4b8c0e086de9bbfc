"""Which tensors a conversion quantizes, and what they cost stored.

Schemes: `none` (bf16; fp32 tensors such as e_score_correction_bias stay fp32), `fp8` (e4m3fn +
float32 scale per 128x128 block, DeepSeek naming `weight_scale_inv`), `int8` (symmetric per output
channel, `weight_scale` [out, 1]), `int4` (symmetric, one float32 scale per `group_size` inputs,
nibbles packed two per byte: `weight_packed` uint8 [out, in/2] + `weight_scale` [out, in/group];
routed experts only by default, as Kimi's INT4 releases). The manifest's `quantize` flag is the default; `--keep PATTERN`
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

SCHEMES = ("none", "fp8", "int8", "int4")
SCALE_FORMATS = ("fp32", "ue8m0")


@dataclass(frozen=True)
class QuantPolicy:
    scheme: str = "none"
    keep: tuple[str, ...] = ()
    force: tuple[str, ...] = ()
    scale_format: str = "fp32"
    group_size: int = 32  # int4
    int4_scales: str = "mse"  # int4: clipping search ("mse") or plain amax / 7 ("amax")

    def __post_init__(self):
        if self.scheme not in SCHEMES:
            raise UsageError(f"unknown --quant {self.scheme!r} (choose from {', '.join(SCHEMES)})")
        if self.scale_format not in SCALE_FORMATS:
            raise UsageError(f"unknown --scale-format {self.scale_format!r} (choose from {', '.join(SCALE_FORMATS)})")
        if self.scheme == "int4" and (self.group_size < 2 or self.group_size % 2):
            raise UsageError(f"--group-size must be an even number >= 2, got {self.group_size}")
        if self.int4_scales not in ("mse", "amax"):
            raise UsageError(f"unknown --int4-scales {self.int4_scales!r} (mse or amax)")

    def quantizes(self, info: TensorInfo, shape: tuple[int, ...]) -> bool:
        if self.scheme == "none" or len(shape) != 2:
            return False
        if any(fnmatch.fnmatchcase(info.name, p) for p in self.keep):
            return False
        if any(fnmatch.fnmatchcase(info.name, p) for p in self.force):
            return True
        if self.scheme == "int4":  # weight-only int4 is for the routed experts, as released
            return info.quantize and info.expert is not None
        return info.quantize

    def stored_bytes(self, info: TensorInfo, shape: tuple[int, ...], src_itemsize: int = 2) -> int:
        """Bytes this tensor takes in the converted checkpoint, scales included."""
        n = math.prod(shape)
        if not self.quantizes(info, shape):
            return n * (4 if src_itemsize == 4 else 2)
        if self.scheme == "fp8":
            return n + 4 * math.ceil(shape[0] / FP8_BLOCK) * math.ceil(shape[1] / FP8_BLOCK)
        if self.scheme == "int4":  # two values per byte + one float32 scale per group
            return n // 2 + 4 * shape[0] * math.ceil(shape[1] / self.group_size)
        return n + 4 * shape[0]  # int8: one float32 scale per output row
