"""What a conversion plan is made of (convert/shard/plan.py makes it): each rank's file of a unit (`WorkItem`) and,
in order, its `Output`s: a source slice, how it is transformed and the 1-2 tensors it becomes.

Transforms: `copy` (plain, kept dtype), `bf16` (dequantized source kept in high precision), a scheme's
name from kconvert/quant/registry.py (`fp8`, `int8`, `int4`: quantize the slice), or a scheme's lossless
copy (`fp8_copy`: block-FP8 source resharded on block boundaries, weight and scale bytes unchanged).
What each stores (names, dtypes, shapes) is the scheme's `specs`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import NamedTuple
from collections.abc import Iterator
from itertools import chain, repeat
from operator import attrgetter

from kconvert.disk_format.units import unit_file
from kconvert.convert.layout import Piece
from kconvert.family.manifest import TensorInfo
from kconvert.io.dtypes import FP8_BLOCK, specs_bytes
from kconvert.quant.registry import scheme_of_transform
from kconvert.quant.scheme import LosslessCopy, Options, Scheme, input_bytes


class How:
    """What the outputs of one planned decision share (a bucket's expert group on one rank: up to 896 outputs), made
    once by the plan; every field but the source's name and its TensorInfo. Not to be changed once made."""

    __slots__ = ("piece", "transform", "shape", "src_dtype", "scale_format", "group_size", "int4_scales", "fp8_block",
                 "copy", "stack_part", "bytes_in", "bytes_out")

    def __init__(self, piece: Piece, transform: str, shape: tuple[int, ...], src_dtype: str, scale_format: str = "fp32",
                 group_size: int = 32, int4_scales: str = "mse", fp8_block: int = FP8_BLOCK,
                 copy: LosslessCopy | None = None, stack_part: int | None = None):
        self.piece, self.transform, self.shape, self.src_dtype = piece, transform, shape, src_dtype
        self.scale_format, self.group_size, self.int4_scales, self.fp8_block = scale_format, group_size, int4_scales, fp8_block
        self.copy, self.stack_part = copy, stack_part
        self.bytes_in, self.bytes_out = bytes_of(shape, src_dtype, transform, scale_format, group_size, int4_scales,
                                                 fp8_block)


def _shared(field_: str) -> property:
    return property(attrgetter(f"how.{field_}"), doc=f"The output's {field_} (its How's).")


class Output(NamedTuple):
    """One source slice and the 1-2 tensors it becomes: its source name, its TensorInfo, what it shares with the
    other outputs of its plan decision (`how`: the slice, the transform, the sizes) and the tensors it writes. A
    release's plan makes 250k+ of them: a named tuple the plan builds a bucket at a time from C (tuple.__new__
    over columns), not an object set up field by field."""

    src: str
    info: TensorInfo
    how: How
    spec_rows: tuple  # the tensors it writes: (name, dtype tag, shape) each (specs())

    piece = _shared("piece")
    transform = _shared("transform")  # copy | bf16 | a scheme (fp8 | int8 | int4) | a scheme's lossless copy (fp8_copy)
    shape = _shared("shape")  # of the slice
    src_dtype = _shared("src_dtype")
    scale_format = _shared("scale_format")
    group_size = _shared("group_size")  # int4
    int4_scales = _shared("int4_scales")  # int4
    fp8_block = _shared("fp8_block")  # fp8
    copy = _shared("copy")  # the source parts a lossless copy writes unchanged
    # what it puts in its weight's stack key (convert/shard/stacks.py): the plan's id of (the source's stored form,
    # where it cuts, how it is stored); None: never stacked
    stack_part = _shared("stack_part")
    bytes_in = _shared("bytes_in")  # the source bytes it reads (asked by planning, progress and the stacks)
    bytes_out = _shared("bytes_out")  # the tensor bytes it writes (quantized, scales included)

    @property
    def scheme(self) -> Scheme | None:
        """The scheme this output is stored in (quantized or copied); None when kept unquantized."""
        return scheme_of_transform(self.how.transform)

    @property
    def options(self) -> Options:
        h = self.how
        return options_of(h.scale_format, h.group_size, h.int4_scales, h.fp8_block)

    def specs(self) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
        """The tensors this output writes (name, dtype tag, shape): made by the plan (spec_rows), asked by the
        writer, the stacks and the catalog."""
        return self.spec_rows

    def __repr__(self) -> str:
        h = self.how
        return f"Output({self.src!r}, {h.piece}, {h.transform}, {h.shape}, {h.src_dtype})"


def outputs_of(names: list[str], infos: list[TensorInfo], how: How, suffixes: tuple | None) -> Iterator[Output]:
    """The Outputs of `names` (their infos) planned alike (`how`), each spec `name + suffix` (spec_suffixes), or the
    scheme's own where they are not so: made from columns at C speed (a layer's 896 experts at once)."""
    if suffixes is None:  # (DeepSeek-V4's `.scale` sidecars)
        opts = options_of(how.scale_format, how.group_size, how.int4_scales, how.fp8_block)
        rows = [_specs(n, how.transform, how.shape, how.src_dtype, opts) for n in names]
    elif len(suffixes) == 1 and not suffixes[0][0]:  # the tensor kept or cast: its own name
        _, tag, shape = suffixes[0]
        rows = [((n, tag, shape),) for n in names]
    elif len(suffixes) == 2 and not suffixes[0][0]:  # a quantized weight under its name + its scale
        (_, tag, shape), (s1, tag1, shape1) = suffixes
        rows = [((n, tag, shape), (n + s1, tag1, shape1)) for n in names]
    else:
        rows = [tuple([(n + suffix, tag, shape) for suffix, tag, shape in suffixes]) for n in names]
    return map(_new_output, zip(names, infos, repeat(how), rows))


_new_output = functools.partial(tuple.__new__, Output)


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
        return list(chain.from_iterable(map(_SPECS, self.outputs)))

    @property
    def bytes_in(self) -> int:
        return sum(map(_BYTES_IN, self.outputs))

    @property
    def bytes_out(self) -> int:
        """The tensor bytes this file will hold (quantized, scales included; header aside)."""
        return sum(map(_BYTES_OUT, self.outputs))


_BYTES_IN, _BYTES_OUT, _SPECS = attrgetter("how.bytes_in"), attrgetter("how.bytes_out"), attrgetter("spec_rows")
SRC = attrgetter("src")
