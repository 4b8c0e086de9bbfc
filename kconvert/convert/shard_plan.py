"""Plan a conversion from headers alone: every (rank, unit) output file and, in order, the tensors
it will hold, each with the source slice it comes from and how it is transformed.

Transforms: `copy` (plain, kept dtype), `bf16` (dequantized source kept in high precision),
`fp8` / `int8` (quantize the slice), `fp8_copy` (block-FP8 source resharded on block boundaries:
weight and scale bytes copied unchanged, lossless).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kconvert.source.checkpoint import Checkpoint
from kconvert.converted.units import GLOBALS, VISION, layer_unit, unit_file, unit_layer
from kconvert.errors import UsageError
from kconvert.convert.layout import TP_DEGREES, Layout, Piece, check, pieces
from kconvert.family.manifest import TensorInfo
from kconvert.convert.quant_policy import FP8_BLOCK, QuantPolicy
from kconvert.convert.stages import FIRST, LAST, StageSplit, edges_of, split_layers
from kconvert.io.dtypes import ITEMSIZE, specs_bytes


@dataclass(frozen=True)
class Output:
    """One source slice and the 1-2 tensors it becomes."""

    src: str
    info: TensorInfo
    piece: Piece
    transform: str  # copy | bf16 | fp8 | int8 | int4 | fp8_copy
    shape: tuple[int, ...]  # of the slice
    src_dtype: str
    scale_format: str = "fp32"
    group_size: int = 32  # int4
    int4_scales: str = "mse"  # int4

    def specs(self) -> list[tuple[str, str, tuple[int, ...]]]:
        r, c = (self.shape + (0, 0))[:2]
        if self.transform in ("fp8", "fp8_copy"):
            grid = (-(-r // FP8_BLOCK), -(-c // FP8_BLOCK))
            return [(self.src, "F8_E4M3", self.shape), (self.src + "_scale_inv", "F32", grid)]
        if self.transform == "int8":
            return [(self.src, "I8", self.shape), (self.src + "_scale", "F32", (r, 1))]
        if self.transform == "int4":
            return [(self.src + "_packed", "U8", (r, c // 2)), (self.src + "_scale", "F32", (r, c // self.group_size))]
        tag = self.src_dtype if self.transform == "copy" else "BF16"
        return [(self.src, tag, self.shape)]

    @property
    def bytes_in(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * (1 if self.src_dtype in ("I4", "F8_E4M3") else ITEMSIZE.get(self.src_dtype, 2))


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
        return specs_bytes(self.specs())


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
    for name, t in ck.logical.items():
        info = ck.info(name)
        if info.component == "mtp" and not keep_mtp:
            continue
        quant = policy.quantizes(info, t.shape)
        for p in pieces(info, t.shape, layout, n_experts):
            shape = list(t.shape)
            if p.dim is not None:
                shape[p.dim] = p.stop - p.start
            transform = _transform(t.format, quant, policy, ck, p, t.shape)
            if transform == "fp8_misaligned":
                if not requantize:
                    misaligned.append(name)
                    break
                transform = "fp8"
            if transform == "int4" and shape[1] % policy.group_size:
                raise UsageError(f"--quant int4: {shape[1]} inputs per rank do not divide into groups of "
                                 f"{policy.group_size}; choose another --group-size", tensor=name)
            unit = unit_of(info)
            item = items.setdefault((unit, p.rank), WorkItem(p.rank, unit))
            item.outputs.append(Output(name, info, p, transform, tuple(shape), t.stored_dtype, policy.scale_format,
                                       policy.group_size, policy.int4_scales))
    if misaligned:
        works = [tp for tp in TP_DEGREES if _fp8_aligned(ck, tp, layout, policy)]
        raise UsageError(f"block-FP8 source: --tp {layout.tp} cuts {misaligned[0]} (and {len(misaligned) - 1} more) "
                         f"inside a {FP8_BLOCK}x{FP8_BLOCK} scale block; tp degrees that keep blocks whole: "
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
                edge[e][w.rank] += WorkItem(w.rank, w.unit, [o]).bytes_out
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


def _transform(fmt: str, quant: bool, policy: QuantPolicy, ck: Checkpoint, p: Piece, shape) -> str:
    if not quant:
        return "copy" if fmt == "plain" else "bf16"
    if policy.scheme == "fp8" and fmt == "block_fp8" and ck.quant_block() == (FP8_BLOCK, FP8_BLOCK):
        source_ue8m0 = ck.quantization_config.get("scale_fmt") == "ue8m0"
        if policy.scale_format == "fp32" or source_ue8m0:
            return "fp8_copy" if _aligned(p, shape) else "fp8_misaligned"
    return policy.scheme


def _aligned(p: Piece, shape) -> bool:
    return p.dim is None or (p.start % FP8_BLOCK == 0 and (p.stop % FP8_BLOCK == 0 or p.stop == shape[p.dim]))


def _fp8_aligned(ck: Checkpoint, tp: int, layout: Layout, policy: QuantPolicy) -> bool:
    try:
        other = Layout.make(tp, tp if layout.ep == layout.tp else layout.ep)
        check(ck.model, other)
    except UsageError:
        return False
    for name, t in ck.logical.items():
        info = ck.info(name)
        if t.format == "block_fp8" and policy.quantizes(info, t.shape):
            if not all(_aligned(p, t.shape) for p in pieces(info, t.shape, other, ck.model.text.expert_count)):
                return False
    return True
