"""Plan a conversion from headers alone: every (rank, unit) output file and, in order, the tensors
it will hold, each with the source slice it comes from and how it is transformed.

Transforms: `copy` (plain, kept dtype), `bf16` (dequantized source kept in high precision), a scheme's
name from kconvert/quant/registry.py (`fp8`, `int8`, `int4`: quantize the slice), or a scheme's lossless
copy (`fp8_copy`: block-FP8 source resharded on block boundaries, weight and scale bytes unchanged).
What each stores (names, dtypes, shapes) is the scheme's `specs`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from kconvert.source.checkpoint import Checkpoint
from kconvert.converted.units import GLOBALS, VISION, layer_unit, unit_file, unit_layer
from kconvert.errors import UsageError
from kconvert.convert.layout import TP_DEGREES, Layout, Piece, check, pieces
from kconvert.family.manifest import TensorInfo
from kconvert.convert.quant_policy import FP8_BLOCK, QuantPolicy, source_quant
from kconvert.convert.stages import FIRST, LAST, StageSplit, edges_of, split_layers
from kconvert.io.dtypes import specs_bytes
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
    copy: LosslessCopy | None = None  # the source parts a lossless copy writes unchanged

    @property
    def scheme(self) -> Scheme | None:
        """The scheme this output is stored in (quantized or copied); None when kept unquantized."""
        return scheme_of_transform(self.transform)

    @property
    def options(self) -> Options:
        return _options(self.scale_format, self.group_size, self.int4_scales)

    def specs(self) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
        """The tensors this output writes (name, dtype tag, shape): worked out once, asked by the writer, the
        stacks and the catalog."""
        got = self.__dict__.get("_specs")
        if got is None:
            scheme = self.scheme
            got = tuple(scheme.specs(self.src, self.shape, self.options)) if scheme is not None else \
                ((self.src, self.src_dtype if self.transform == "copy" else "BF16", self.shape),)
            object.__setattr__(self, "_specs", got)  # a cache beside the frozen fields
        return got

    @property
    def bytes_in(self) -> int:
        return input_bytes(self.shape, self.src_dtype)

    @property
    def bytes_out(self) -> int:
        """The tensor bytes it writes (quantized, scales included), worked out once like `specs`."""
        got = self.__dict__.get("_bytes_out")
        if got is None:
            got = specs_bytes(self.specs())
            object.__setattr__(self, "_bytes_out", got)
        return got


@functools.lru_cache(maxsize=64)
def _options(scale_format: str, group_size: int, int4_scales: str) -> Options:
    return Options(scale_format, group_size, int4_scales)  # one object per run, not one per output tensor


@dataclass
class WorkItem:
    rank: int
    unit: str
    outputs: list[Output] = field(default_factory=list)

    @property
    def file(self) -> str:
        return unit_file(self.rank, self.unit)

    def specs(self) -> list[tuple[str, str, tuple[int, ...]]]:
        return [s for o in self.outputs for s in o.specs()]

    @property
    def bytes_in(self) -> int:
        return sum(o.bytes_in for o in self.outputs)

    @property
    def bytes_out(self) -> int:
        """The tensor bytes this file will hold (quantized, scales included; header aside)."""
        return sum(o.bytes_out for o in self.outputs)


def unit_of(info: TensorInfo) -> str:
    if info.group in ("vision", "projector"):
        return "vision"
    return GLOBALS if info.layer is None else layer_unit(info.layer)


def plan_items(ck: Checkpoint, layout: Layout, policy: QuantPolicy, *, requantize: bool = False,
               keep_mtp: bool = False) -> list[WorkItem]:
    """All work items in load order (globals, vision, layer 0, 1, ...; rank-major within a unit)."""
    ck.validate()
    check(ck.model, layout)
    n_experts = ck.model.text.expert_count
    items: dict[tuple[str, int], WorkItem] = {}
    misaligned: list[str] = []
    whole_copies: set[str] = set()
    scheme, opts = policy.quant, policy.options
    copies: dict[str, LosslessCopy | None] = {}  # by source format: the same answer for 70k tensors
    for name, t in ck.logical.items():
        info = ck.info(name)
        if info.component == "mtp" and not keep_mtp:
            continue
        quant = policy.quantizes(info, t.shape)
        copy = None
        if quant:
            if t.format not in copies:
                copies[t.format] = scheme.lossless_copy(source_quant(ck, t), opts)
            copy = copies[t.format]
        for p in pieces(info, t.shape, layout, n_experts):
            shape = list(t.shape)
            if p.dim is not None:
                shape[p.dim] = p.stop - p.start
            transform = scheme.name if quant else "copy" if t.format == "plain" else "bf16"
            piece_copy = copy
            if copy is not None and not _aligned(p, t.shape, copy.block, copy.whole):
                if not requantize:
                    misaligned.append(name)
                    if copy.whole:
                        whole_copies.add(name)
                    break
                piece_copy = None
            if piece_copy is not None:
                transform = piece_copy.transform
            if quant and piece_copy is None and (why := scheme.misfit(tuple(shape), opts)):
                raise UsageError(f"--quant {scheme.name}: {why}", tensor=name)
            unit = unit_of(info)
            item = items.setdefault((unit, p.rank), WorkItem(p.rank, unit))
            item.outputs.append(Output(name, info, p, transform, tuple(shape), t.stored_dtype, policy.scale_format,
                                       policy.group_size, policy.int4_scales, piece_copy))
    if misaligned:
        works = [tp for tp in TP_DEGREES if _copies_aligned(ck, tp, layout, policy)]
        where = ("a packed FP4 tensor (copied whole only)" if misaligned[0] in whole_copies
                 else f"a {FP8_BLOCK}x{FP8_BLOCK} scale block")
        raise UsageError(f"quantized source: --tp {layout.tp} cuts {misaligned[0]} (and {len(misaligned) - 1} more) "
                         f"inside {where}; tp degrees that keep blocks whole: "
                         f"{', '.join(map(str, works)) or 'none'}; or pass --requantize to re-quantize those slices")
    order = {"globals": -2, "vision": -1}
    for item in items.values():
        item.outputs.sort(key=lambda o: o.src)
    return sorted(items.values(), key=lambda w: (order.get(w.unit, 0), w.unit, w.rank))


@dataclass
class Pipeline:
    """A conversion's pipeline stages: the work items with global ranks (stage * tp + tp rank), the layer
    split and every stage's units (the catalog's layout.stages)."""

    items: list[WorkItem]
    split: StageSplit
    stage_units: list[list[str]]


def plan_pipeline(items: list[WorkItem], tp: int, pp: int, n_layers: int, *, pp_layers: str | None = None,
                  tied: bool = False) -> Pipeline:
    """Place the tp-rank work items of `plan_items` on `pp` stages. The split balances the bytes each
    rank will write (convert.stages); `globals` is cut in two with pp > 1: embeddings on the first stage,
    final norm and head on the last (the embeddings too when `tied` and there is no head); vision and
    the first layers on the first stage, MTP layers (n_layers and up) on the last. pp = 1: the items
    are returned unchanged."""
    tied_without_head = tied and not any(o.info.component == "head" for w in items for o in w.outputs)
    layer_bytes = [[0] * tp for _ in range(n_layers)]
    edge = {FIRST: [0] * tp, LAST: [0] * tp}
    for w in items:
        L = unit_layer(w.unit)
        if L is not None and L < n_layers:
            layer_bytes[L][w.rank] += w.bytes_out
            continue
        for o in w.outputs:  # globals, vision, MTP layers: by what each tensor is
            to = (LAST,) if L is not None else edges_of(o.info.component, tied_without_head)
            for e in to:
                edge[e][w.rank] += o.bytes_out
    split = split_layers(layer_bytes, pp, edge[FIRST], edge[LAST], pp_layers)
    units = [[] for _ in range(pp)]
    for u in dict.fromkeys(w.unit for w in items):
        L = unit_layer(u)
        stages = {0, pp - 1} if u == GLOBALS else {0} if u == VISION else {split.stage_of_layer(L)}
        for s in sorted(stages):
            units[s].append(u)
    if pp == 1:
        return Pipeline(items, split, units)
    placed: list[WorkItem] = []
    for w in items:
        L = unit_layer(w.unit)
        if w.unit != GLOBALS:
            s = 0 if L is None else split.stage_of_layer(L)
            placed.append(WorkItem(s * tp + w.rank, w.unit, w.outputs))
            continue
        for s, e in ((0, FIRST), (pp - 1, LAST)):
            outs = [o for o in w.outputs if e in edges_of(o.info.component, tied_without_head)]
            placed.append(WorkItem(s * tp + w.rank, w.unit, outs))
    order = {GLOBALS: -2, VISION: -1}
    placed.sort(key=lambda w: (order.get(w.unit, 0), w.unit, w.rank))
    return Pipeline(placed, split, units)


def _aligned(p: Piece, shape, block: int, copy_whole: bool = False) -> bool:
    """A slice a block-wise copy can take: whole, or starting on a block and ending on one (or at the end)."""
    return (not block or p.dim is None
            or (not copy_whole and p.start % block == 0 and (p.stop % block == 0 or p.stop == shape[p.dim])))


def _copies_aligned(ck: Checkpoint, tp: int, layout: Layout, policy: QuantPolicy) -> bool:
    """Whether `tp` (same expert placement) cuts every losslessly copied tensor on its blocks."""
    try:
        other = Layout.make(tp, tp if layout.ep == layout.tp else layout.ep)
        check(ck.model, other)
    except UsageError:
        return False
    for name, t in ck.logical.items():
        info = ck.info(name)
        if not policy.quantizes(info, t.shape):
            continue
        copy = policy.quant.lossless_copy(source_quant(ck, t), policy.options)
        if copy is not None and not all(_aligned(p, t.shape, copy.block, copy.whole)
                                        for p in pieces(info, t.shape, other, ck.model.text.expert_count)):
            return False
    return True
