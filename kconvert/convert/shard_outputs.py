"""What a conversion plan is made of (convert/shard_plan.py makes it): each rank's file of a unit (`WorkItem`) and,
in order, its `Output`s: a source slice, how it is transformed and the 1-2 tensors it becomes.

Transforms: `copy` (plain, kept dtype), `bf16` (dequantized source kept in high precision), a scheme's
name from kconvert/quant/registry.py (`fp8`, `int8`, `int4`: quantize the slice), or a scheme's lossless
copy (`fp8_copy`: block-FP8 source resharded on block boundaries, weight and scale bytes unchanged).
What each stores (names, dtypes, shapes) is the scheme's `specs`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields
from itertools import chain
from operator import attrgetter

from kconvert.converted.units import unit_file
from kconvert.convert.layout import Piece
from kconvert.family.manifest import TensorInfo
from kconvert.io.dtypes import FP8_BLOCK, specs_bytes
from kconvert.quant.registry import scheme_of_transform
from kconvert.quant.scheme import LosslessCopy, Options, Scheme, input_bytes


@dataclass(frozen=True)
class Output:
    """One source slice and the 1-2 tensors it becomes."""

    src: str
    info: TensorInfo
    piece: Piece
    transform: str  # copy | bf16 | a scheme (fp8 | int8 | int4) | a scheme's lossless copy (fp8_copy)
    shape: tuple[int, ...]  # of the slice
    src_dtype: str
    scale_format: str = "fp32"
    group_size: int = 32  # int4
    int4_scales: str = "mse"  # int4
    fp8_block: int = FP8_BLOCK  # fp8
    copy: LosslessCopy | None = None  # the source parts a lossless copy writes unchanged
    # what it puts in its weight's stack key (convert/shard_stacks.py): the plan's id of (the source's stored form,
    # where it cuts, how it is stored); None: never stacked. Set by the plan once per bucket (not a field).
    stack_part = None

    @property
    def scheme(self) -> Scheme | None:
        """The scheme this output is stored in (quantized or copied); None when kept unquantized."""
        return scheme_of_transform(self.transform)

    @property
    def options(self) -> Options:
        return options_of(self.scale_format, self.group_size, self.int4_scales, self.fp8_block)

    def specs(self) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
        """The tensors this output writes (name, dtype tag, shape): worked out once, asked by the writer, the
        stacks and the catalog."""
        got = self.__dict__.get("_specs")
        if got is None:
            got = _specs(self.src, self.transform, self.shape, self.src_dtype, self.options)
            object.__setattr__(self, "_specs", got)  # a cache beside the frozen fields
        return got

    @functools.cached_property  # (the plan sets it with the fields: then reading it is a plain attribute's cost)
    def bytes_in(self) -> int:
        """The source bytes it reads (asked by planning, progress and the stacks)."""
        return bytes_of(self.shape, self.src_dtype, self.transform, self.scale_format, self.group_size,
                        self.int4_scales, self.fp8_block)[0]

    @functools.cached_property  # (set by the plan too, as bytes_in is)
    def bytes_out(self) -> int:
        """The tensor bytes it writes (quantized, scales included)."""
        return bytes_of(self.shape, self.src_dtype, self.transform, self.scale_format, self.group_size,
                        self.int4_scales, self.fp8_block)[1]


def _specs(src: str, transform: str, shape: tuple[int, ...], src_dtype: str, opts: Options) -> tuple:
    scheme = scheme_of_transform(transform)
    if scheme is not None:
        return tuple(scheme.specs(src, shape, opts))
    return ((src, src_dtype if transform == "copy" else "BF16", shape),)


_PROBES = ("a.weight", "bb.weight")  # two source names: a spec name that is not name + suffix differs between them


@functools.lru_cache(maxsize=4096)
def spec_suffixes(transform: str, shape: tuple[int, ...], src_dtype: str, scale_format: str, group_size: int,
                  int4_scales: str, fp8_block: int = FP8_BLOCK) -> tuple | None:
    """An output's specs as (suffix, tag, shape), each name being the source's name + suffix (every scheme's but
    DeepSeek-V4's `.scale` sidecars): the plan makes 100k+ outputs' specs by concatenation. None: not so."""
    opts = options_of(scale_format, group_size, int4_scales, fp8_block)
    out = []
    for (a, tag, shp), (b, tag_b, shp_b) in zip(*(_specs(p, transform, shape, src_dtype, opts) for p in _PROBES)):
        suffix = a[len(_PROBES[0]):]
        if not a.startswith(_PROBES[0]) or b != _PROBES[1] + suffix or (tag, shp) != (tag_b, shp_b):
            return None
        out.append((suffix, tag, shp))
    return tuple(out)


@functools.lru_cache(maxsize=4096)
def bytes_of(shape: tuple[int, ...], src_dtype: str, transform: str, scale_format: str, group_size: int,
             int4_scales: str, fp8_block: int = FP8_BLOCK) -> tuple[int, int]:
    """(bytes read, bytes written) of an output: names aside, its fields decide them, and 150k outputs of a
    release share a few hundred such keys."""
    specs = _specs("w", transform, shape, src_dtype, options_of(scale_format, group_size, int4_scales, fp8_block))
    return input_bytes(shape, src_dtype), specs_bytes(specs)


@functools.lru_cache(maxsize=64)
def options_of(scale_format: str, group_size: int, int4_scales: str, fp8_block: int = FP8_BLOCK) -> Options:
    return Options(scale_format, group_size, int4_scales, fp8_block=fp8_block)  # one object per run, not per tensor


@dataclass
class WorkItem:
    rank: int
    unit: str
    outputs: list[Output] = field(default_factory=list)

    @property
    def file(self) -> str:
        return unit_file(self.rank, self.unit)

    def specs(self) -> list[tuple[str, str, tuple[int, ...]]]:
        return list(chain.from_iterable(map(_SPECS, self.outputs)))  # the plan made each output's (shard_plan._add)

    @property
    def bytes_in(self) -> int:
        return sum(map(_BYTES_IN, self.outputs))

    @property
    def bytes_out(self) -> int:
        """The tensor bytes this file will hold (quantized, scales included; header aside)."""
        return sum(map(_BYTES_OUT, self.outputs))


_BYTES_IN, _BYTES_OUT, _SPECS = attrgetter("bytes_in"), attrgetter("bytes_out"), attrgetter("_specs")
SRC = attrgetter("src")
# an Output's fields, then what the plan sets beside them (shard_plan._add: one dict update an output)
OUTPUT_FIELDS = (*(f.name for f in fields(Output)), "stack_part", "bytes_in", "bytes_out")
