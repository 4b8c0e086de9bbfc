"""Plan a conversion from headers alone: every (rank, unit) output file and, in order, the tensors
it will hold, each with the source slice it comes from and how it is transformed (convert/shard/outputs.py).
A validation bucket is planned at once (one decision per rule, layer and expert group); name by name only where
a bucket's members differ, which gives the refusals a walk in stored order meets.
"""

from __future__ import annotations

import functools
from itertools import groupby, repeat

from kconvert.source.checkpoint import Checkpoint
from kconvert.disk_format.units import GLOBALS, layer_unit
from kconvert.errors import UsageError
from kconvert.convert.layout import TP_DEGREES, Layout, Piece, check, pieces
from kconvert.convert.shard.outputs import SRC, How, WorkItem, outputs_of, spec_suffixes
from kconvert.family.manifest import TensorInfo
from kconvert.quant.policy import QuantPolicy
from kconvert.source.stored_quant import rows_copy, source_quant
from kconvert.quant.scheme import LosslessCopy, Scheme
from kconvert.quant.stacking import STACKED_COPIES
from kconvert.source.logical import stack_form


STACK_ELEMS = 1 << 18  # values of a weight; larger ones are read and quantized alone (their data sets the pace)


def _stack_part(parts: dict[tuple, int], form: tuple | None, p: Piece, copy, info: TensorInfo,
                how: tuple) -> int | None:
    """A small id per distinct (stored form, cut, how it is stored): a stack key, hashed per weight, stays cheap.
    how: (transform, scale_format, group_size, int4_scales, fp8_block)."""
    if form is None or info.rule.values_below is not None:
        return None  # read alone, a table checked by value
    if copy is not None and (p.dim is not None or copy.transform not in STACKED_COPIES):
        return None  # a lossless copy other than a whole FP4 expert's (quant/stacked.py copy_parts)
    return parts.setdefault((form, p.dim, p.start, p.stop, how), len(parts))


def unit_of(info: TensorInfo) -> str:
    if info.group in ("vision", "projector"):
        return "vision"
    return GLOBALS if info.layer is None else layer_unit(info.layer)


_info_of = functools.partial(tuple.__new__, TensorInfo)  # a named tuple from its fields, without a Python-level call


class _PerName(Exception):
    """A bucket whose members the bucket-at-a-time plan cannot decide alike (a cut inside a scale block, a shape the
    scheme cannot store, a dim that does not divide): the name-by-name plan decides, and names the tensor a walk
    in stored order meets first, as it always has."""


class _Plan:
    """Every logical tensor's outputs: a validation bucket at a time (source/tensor_groups.py: one rule and layer,
    stored alike, so one decision for up to 384 experts, per expert group), or name by name."""

    def __init__(self, ck: Checkpoint, layout: Layout, policy: QuantPolicy, requantize: bool, keep_mtp: bool):
        self.ck, self.layout, self.policy, self.requantize, self.keep_mtp = ck, layout, policy, requantize, keep_mtp
        self.copies: dict[tuple, LosslessCopy | None] = {}  # by source format and grid: one answer for 70k tensors
        self.stack_parts: dict[tuple, int] = {}  # (stored form, cut, how) -> a small id (_stack_part)

    def by_bucket(self) -> dict[tuple[str, int], WorkItem]:
        items: dict[tuple[str, int], WorkItem] = {}
        for b in self.ck.grouped.buckets:
            info0, t = b.info, b.sample
            group_size = info0.rule.part.expert_count // self.layout.ep if info0.split == "expert" else 0
            if info0.component == "mtp" and not self.keep_mtp:
                continue
            scheme, copy = self._quant(info0, t)
            unit, plans = unit_of(info0), {}  # expert group (None: not an expert) -> the pieces' plan
            names, rule, layer = b.names, b.rule, b.layer
            infos = list(map(_info_of, zip(names, repeat(rule), repeat(layer), b.experts)))
            for key, i, j in _runs(b.experts, group_size):
                plan = plans.get(key)
                if plan is None:  # decided by the expert group's first member, as a walk name by name decides it
                    try:
                        plan = self._pieces(infos[i], t, scheme, copy)
                    except UsageError:
                        raise _PerName from None
                    if plan is None:
                        raise _PerName
                    plan = plans[key] = _targets(items, unit, plan)
                _add(names[i:j], infos[i:j], plan)
        return items

    def by_name(self) -> tuple[dict[tuple[str, int], WorkItem], list[str], set[str]]:
        items: dict[tuple[str, int], WorkItem] = {}
        misaligned: list[str] = []
        whole_copies: set[str] = set()
        for name, t in self.ck.logical.items():
            info = self.ck.info(name)
            if info.component == "mtp" and not self.keep_mtp:
                continue
            scheme, copy = self._quant(info, t)
            plan = self._pieces(info, t, scheme, copy)
            if plan is None:
                misaligned.append(name)
                if copy.whole:
                    whole_copies.add(name)
                continue
            _add([name], [info], _targets(items, unit_of(info), plan))
        return items, misaligned, whole_copies

    def _quant(self, info: TensorInfo, t) -> tuple[Scheme | None, LosslessCopy | None]:
        """The scheme `t` is stored in (None: kept) and the lossless copy of its stored parts it takes, if any."""
        if info.rule.scale_block is not None and t.format != "plain":  # its own FP8 grid (V4.1's Engram rows):
            return None, rows_copy(self.ck, t)  # copied as stored under any scheme (a bf16 table stays bf16)
        scheme = self.policy.scheme_for(info, t.shape, self.ck.model.family)  # (the source's family, whoever asks)
        if scheme is None:
            return None, None
        key = (scheme.name, t.format, tuple(t.parts) if t.format == "nvfp4_packed" else ())
        if key not in self.copies:
            self.copies[key] = scheme.lossless_copy(source_quant(self.ck, t, info), self.policy.options)
        return scheme, self.copies[key]

    def _pieces(self, info: TensorInfo, t, scheme: Scheme | None, copy: LosslessCopy | None) -> list[tuple] | None:
        """(rank, every field of its Output but src and info, its specs' suffixes or None) per rank; None: a piece
        cuts inside a scale block and --requantize was not given. UsageError: a dim that does not divide, a shape
        the scheme refuses. What all the tensors of a bucket's expert group share, worked out once."""
        quant, opts, pol, out = scheme is not None, self.policy.options, self.policy, []
        dtype, options = t.stored_dtype, (pol.scale_format, pol.group_size, pol.int4_scales, pol.fp8_block)
        form = stack_form(t) if t.numel <= STACK_ELEMS else None
        for p in pieces(info, t.shape, self.layout):
            shape = list(t.shape)
            if p.dim is not None:
                shape[p.dim] = p.stop - p.start
            transform = scheme.name if quant else "copy" if t.format == "plain" else "bf16"
            piece_copy = copy
            if copy is not None and not _aligned(p, t.shape, copy.block, copy.whole):
                if not self.requantize:
                    return None
                piece_copy = None
            if piece_copy is not None:
                transform = piece_copy.transform
            if quant and piece_copy is None and (why := scheme.misfit(tuple(shape), opts)):
                raise UsageError(f"--quant {scheme.name}: {why}", tensor=info.name)
            shape, how = tuple(shape), (transform, *options)
            part = _stack_part(self.stack_parts, form, p, piece_copy, info, how)
            out.append((p.rank, How(p, transform, shape, dtype, *options, piece_copy, part),
                        spec_suffixes(transform, shape, dtype, *options)))
        return out


def _targets(items: dict, unit: str, plan: list[tuple]) -> list[tuple[list, How, tuple | None]]:
    """A plan's pieces with their rank's output list (in `unit`'s file) in place of the rank."""
    out = []
    for rank, how, suffixes in plan:
        item = items.get((unit, rank))
        if item is None:
            item = items[(unit, rank)] = WorkItem(rank, unit)
        out.append((item.outputs, how, suffixes))
    return out


def _add(names: list[str], infos: list[TensorInfo], targets: list[tuple[list, How, tuple | None]]) -> None:
    """Tensors `names`' Outputs (planned alike), one each per target, their specs included (shard_outputs.outputs_of:
    a Python-level step per output was most of planning 250k of them)."""
    for outputs, how, suffixes in targets:
        outputs.extend(outputs_of(names, infos, how, suffixes))


def _runs(experts: list, group_size: int) -> list[tuple[int | None, int, int]]:
    """A bucket's members as runs (expert group, first, end) of the same group; one run (None) when the rule is not
    split by expert (group_size 0)."""
    if not group_size:
        return [(None, 0, len(experts))]
    keys = [e // group_size for e in experts]
    runs, i = [], 0
    for key, members in groupby(keys):
        j = i + sum(1 for _ in members)
        runs.append((key, i, j))
        i = j
    return runs


def plan_items(ck: Checkpoint, layout: Layout, policy: QuantPolicy, *, requantize: bool = False,
               keep_mtp: bool = True) -> list[WorkItem]:
    """All work items in load order (globals, vision, layer 0, 1, ...; rank-major within a unit). keep_mtp: the
    draft heads (MTP layers) are converted, each tensor once, as their own units (False: left out)."""
    ck.validate()
    check(ck.model, layout)
    plan = _Plan(ck, layout, policy, requantize, keep_mtp)
    try:
        if policy.keep or policy.force:  # --keep / --quantize patterns decide name by name
            raise _PerName
        items, misaligned, whole_copies = plan.by_bucket(), [], set()
    except _PerName:
        items, misaligned, whole_copies = plan.by_name()
    if misaligned:
        works = [tp for tp in TP_DEGREES if _copies_aligned(ck, tp, layout, policy)]
        where = ("a packed FP4 tensor (copied whole only)" if misaligned[0] in whole_copies
                 else f"a {policy.fp8_block}x{policy.fp8_block} scale block")
        raise UsageError(f"quantized source: --tp {layout.tp} cuts {misaligned[0]} (and {len(misaligned) - 1} more) "
                         f"inside {where}; tp degrees that keep blocks whole: "
                         f"{', '.join(map(str, works)) or 'none'}; or pass --requantize to re-quantize those slices")
    order = {"globals": -2, "vision": -1}
    for item in items.values():
        item.outputs.sort(key=SRC)
    return sorted(items.values(), key=lambda w: (order.get(w.unit, 0), w.unit, w.rank))


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
        scheme = policy.scheme_for(info, t.shape, ck.model.family)
        if scheme is None:
            continue
        copy = scheme.lossless_copy(source_quant(ck, t), policy.options)
        if copy is not None and not all(_aligned(p, t.shape, copy.block, copy.whole)
                                        for p in pieces(info, t.shape, other)):
            return False
    return True
