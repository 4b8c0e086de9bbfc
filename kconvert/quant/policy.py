"""Which tensors a conversion quantizes, and what they cost stored.

The default is the scheme's (`Scheme.role`: the manifest's `quantize` flag; int4 routed experts
only, as Kimi's INT4 releases; nvfp4 routed experts and, by the family's `[family.nvfp4]`, other roles in
another scheme: block FP8 attention). `--keep PATTERN` and `--quantize PATTERN` (fnmatch globs on tensor
names) override it, keep winning over quantize (a forced tensor takes the run's scheme). Only 2-D weights
are ever quantized. `none` keeps every tensor as stored (bf16; fp32 tensors such as e_score_correction_bias
stay fp32).
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field

from kconvert.errors import UsageError
from kconvert.io.dtypes import FP8_BLOCK
from kconvert.family.manifest import TensorInfo
from kconvert.quant.int4_group import INT4_SCALES
from kconvert.quant.registry import NONE, SHARD_SCHEMES, get_scheme
from kconvert.quant.scheme import SCALE_FORMATS, Options, Scheme, SourceQuant

SCHEMES = SHARD_SCHEMES


def selected(scheme: Scheme | None, info: TensorInfo, shape: tuple[int, ...], keep: tuple[str, ...] = (),
             force: tuple[str, ...] = ()) -> bool:
    """Whether `scheme` quantizes this tensor: 2-D only; then --keep, then --quantize, then the scheme's default."""
    if scheme is None or len(shape) != 2:
        return False
    if any(fnmatch.fnmatchcase(info.name, p) for p in keep):
        return False
    if any(fnmatch.fnmatchcase(info.name, p) for p in force):
        return True
    return scheme.takes(info)


@dataclass(frozen=True)
class QuantPolicy:
    scheme: str = NONE
    keep: tuple[str, ...] = ()
    force: tuple[str, ...] = ()
    scale_format: str = "fp32"
    group_size: int = 32  # int4
    int4_scales: str = "mse"  # int4: clipping search ("mse") or plain amax / 7 ("amax")
    fp8_block: int = FP8_BLOCK  # fp8: the block of one scale (the source's own where it is block FP8: copied)
    requantize: bool = False  # --requantize: FP4 blocks one FP8 scale cannot hold exactly are rounded, not refused
    # the model family's traits (ck.model.family), set once the source is open: what Scheme.role reads (nvfp4's
    # `[family.nvfp4]`); not part of the policy's identity
    family: dict | None = field(default=None, compare=False, hash=False, repr=False)

    def __post_init__(self):
        if self.scheme not in SCHEMES:
            raise UsageError(f"unknown --quant {self.scheme!r} (choose from {', '.join(SCHEMES)})")
        if self.scale_format not in SCALE_FORMATS:
            raise UsageError(f"unknown --scale-format {self.scale_format!r} (choose from {', '.join(SCALE_FORMATS)})")
        problem = self.quant.option_problem(self.options) if self.quant else None
        if problem:
            raise UsageError(problem)
        if self.fp8_block not in (32, 64, 128):
            raise UsageError(f"fp8 blocks of {self.fp8_block}: kconvert writes 32, 64 or 128")
        if self.int4_scales not in INT4_SCALES:
            raise UsageError(f"unknown --int4-scales {self.int4_scales!r} ({' or '.join(INT4_SCALES)})")

    @property
    def quant(self) -> Scheme | None:
        """The scheme object (None for `none`)."""
        return None if self.scheme == NONE else get_scheme(self.scheme)

    @property
    def options(self) -> Options:
        return Options(self.scale_format, self.group_size, self.int4_scales, fp8_block=self.fp8_block,
                       requantize=self.requantize)

    def scheme_for(self, info: TensorInfo, shape: tuple[int, ...], family: dict | None = None) -> Scheme | None:
        """The scheme this tensor is stored in (None: unquantized): 2-D only; then --keep, then --quantize (the
        run's scheme), then its role (Scheme.role, with the family's traits `family`: ck.model.family)."""
        q = self.quant
        if q is None or len(shape) != 2 or any(fnmatch.fnmatchcase(info.name, p) for p in self.keep):
            return None
        if any(fnmatch.fnmatchcase(info.name, p) for p in self.force):
            return q
        name = q.role(info, family if family is not None else self.family or {})
        return None if name is None else get_scheme(name)

    def quantizes(self, info: TensorInfo, shape: tuple[int, ...], family: dict | None = None) -> bool:
        return self.scheme_for(info, shape, family) is not None

    def calibrates(self, info: TensorInfo, shape: tuple[int, ...], source: SourceQuant) -> bool:
        """Whether `--calibrate` computes this weight's codes (GPTQ): stored in the run's own scheme (a family's other
        roles, nvfp4's block FP8 attention, have no calibrated path) and not copied exactly from how the `source`
        stores it (an MXFP4 expert cast to NVFP4 keeps every code: nothing to improve)."""
        scheme = self.scheme_for(info, shape)
        return scheme is not None and scheme is self.quant and scheme.lossless_copy(source, self.options) is None

    def copies_exactly(self, info: TensorInfo, shape: tuple[int, ...], source: SourceQuant) -> bool:
        """Stored in the run's own scheme by an exact copy of the source, so left out of a calibration."""
        scheme = self.scheme_for(info, shape)
        return scheme is not None and scheme is self.quant and scheme.lossless_copy(source, self.options) is not None

    def stored_bytes(self, info: TensorInfo, shape: tuple[int, ...], src_itemsize: int = 2,
                     family: dict | None = None) -> int:
        """Bytes this tensor takes in the converted checkpoint, scales included."""
        if info.rule.scale_block is not None:  # FP8 rows (V4.1's Engram tables): copied as stored by every scheme
            from kconvert.quant.fp8_rows import SCHEME

            return SCHEME.stored_bytes(tuple(shape), self.options)
        scheme = self.scheme_for(info, shape, family)
        if scheme is None:
            return math.prod(shape) * (4 if src_itemsize == 4 else 2)
        return scheme.stored_bytes(tuple(shape), self.options)
