"""A checkpoint's tensors grouped by manifest (rule, layer) straight from the stored entries, without folding them
into logical tensors first: the columnar path `inspect` and `plan` take.

Kimi K3 stores ~495k tensors, 250k logical experts as MXFP4 `weight_packed` + `weight_scale` pairs. Folding each
into a LogicalTensor (logical.fold) and then looking them up by name (tensor_groups.group_tensors) cost more than
parsing the headers. Here each (rule, layer) group's names are generated once, the stored parts of all its
members looked up as columns (`X.weight_packed`, `X.weight_scale`, ...), and checked alike a column at a time; a
bucket's LogicalTensors are made only when asked for (`Members`: inspect and plan read one per bucket).

It takes only what the fold would fold the same way, stored alike: every member of a group in one form (plain, an
MXFP4 pair, an INT4 triple, a block-FP8 pair), and every stored tensor claimed by exactly one member's part.
Anything else (a missing or orphan companion, a partial group, mixed forms, V4's `.scale` sidecars, FP8 with a
compressed-tensors scale, a name the manifest reads otherwise) returns None, and the caller takes the fold and
group_tensors, which name what is wrong exactly as before. tests/source/test_stored_groups.py checks both give the same
buckets.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat
from operator import add, attrgetter

from kconvert.family.manifest import ModelMap
from kconvert.io.safetensors_read import TensorEntry
from kconvert.source.logical import FP8_TAGS, LogicalTensor, _mxfp4_shapes_misfit
from kconvert.source.tensor_groups import Bucket, Grouped, may_overlap, read_back_alike

_NAME, _DTYPE, _SHAPE = attrgetter("name"), attrgetter("dtype"), attrgetter("shape")
# the companions' keys this path looks up (any name + `_scale_inv`; a `.weight` name's `_packed`, `_scale`, `_shape`
# and `.scale` sidecar): a rule whose names end so could be taken for another rule's companion, and is left to fold
COMPANION_SUFFIXES = ("_scale_inv", ".weight_packed", ".weight_scale", ".weight_shape", ".scale", ".input_scale")


class Members(Sequence):
    """A bucket's logical tensors, made from its stored columns on request, as logical.fold makes them."""

    __slots__ = ("names", "shape", "format", "roles", "columns")

    def __init__(self, names: list[str], shape: tuple, fmt: str, roles: tuple[str, ...], columns: list[list]):
        self.names, self.shape, self.format, self.roles, self.columns = names, shape, fmt, roles, columns

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, i: int) -> LogicalTensor:
        parts = [c[i] for c in self.columns]
        if self.format == "plain":
            return LogicalTensor(self.names[i], self.shape, "plain", parts[0])
        if self.format == "fp4_packed":  # MXFP4's U8 scale bytes read as the e8m0 they are (logical._mxfp4)
            parts[1] = parts[1]._replace(dtype="F8_E8M0")
        return LogicalTensor(self.names[i], self.shape, self.format, dict(zip(self.roles, parts)))


def _alike(columns: list[list[TensorEntry]]) -> bool:
    """Every column's entries share their first's dtype and shape (shared objects: mostly identity tests)."""
    for col in columns:
        e0, n = col[0], len(col)
        if list(map(_DTYPE, col)).count(e0.dtype) != n or list(map(_SHAPE, col)).count(e0.shape) != n:
            return False
    return True


def _with(names: list[str], suffix: str) -> list[str]:
    return list(map(add, names, repeat(suffix)))


def _group_members(names: list[str], stored: dict[str, TensorEntry]) -> tuple[int, Members | None] | None:
    """(stored tensors claimed, the group's Members; None when none of it is stored), or None: not one form. The
    first name says which form to look the whole group up in; a member stored otherwise fails that lookup."""
    get, first = stored.get, names[0]
    if first in stored:
        plain = list(map(get, names))
        if None in plain:
            return None
        if first + "_scale_inv" in stored:  # block FP8: the weight and its weight_scale_inv
            scales = list(map(get, _with(names, "_scale_inv")))
            if None in scales or not _alike([plain, scales]):
                return None
            return 2 * len(names), Members(names, plain[0].shape, "block_fp8", ("weight", "scale"), [plain, scales])
        if first.endswith(".weight") and first[:-7] + ".scale" in stored:  # DeepSeek-V4's `.scale` sidecars
            return _sidecars(names, plain, stored)
        if plain[0].dtype in FP8_TAGS or plain[0].dtype == "I8" or not _alike([plain]):
            return None  # FP8 / INT8 weights pair with a compressed-tensors scale: fold's one-by-one path
        return len(names), Members(names, plain[0].shape, "plain", ("weight",), [plain])
    if first.endswith(".weight") and first + "_packed" in stored:
        packed = list(map(get, _with(names, "_packed")))
        scales = list(map(get, _with(names, "_scale")))
        if None in packed or None in scales:
            return None
        p0, s0 = packed[0], scales[0]
        if first + "_shape" not in stored:  # MXFP4: a U8 [R, C/2] + a U8 e8m0 [R, C/32]
            if p0.dtype != "U8" or s0.dtype != "U8" or len(p0.shape) != 2 or not _alike([packed, scales]) or \
                    _mxfp4_shapes_misfit(p0.shape, s0.shape):
                return None
            return 2 * len(names), Members(names, (p0.shape[0], p0.shape[1] * 2), "fp4_packed", ("weight", "scale"),
                                           [packed, scales])
        shapes = list(map(get, _with(names, "_shape")))  # INT4: int32 words of eight codes, a scale, the weight_shape
        if None in shapes or p0.dtype != "I32" or len(p0.shape) != 2 or not _alike([packed, scales, shapes]):
            return None
        return 3 * len(names), Members(names, (p0.shape[0], p0.shape[1] * 8), "int4_packed",
                                       ("packed", "scale", "shape"), [packed, scales, shapes])
    return 0, None  # the first member not stored as a weight: the group counts as absent, and any member or
    # companion of it that is stored is left unclaimed, so group_stored declines


def _sidecars(names: list[str], weights: list[TensorEntry], stored: dict) -> tuple[int, Members] | None:
    """V4's `X.weight` + `X.scale`, as logical._sidecar folds them: FP8 e4m3 with an e8m0 or float32 2-D block scale,
    or FP4 e2m1 pairs in I8 / U8 with an e8m0 scale per 32 inputs."""
    scales = list(map(stored.get, [n[:-7] + ".scale" for n in names]))
    if None in scales or not _alike([weights, scales]) or list(map(_NAME, weights)) != names:
        return None  # (a weight stored under another spelling: fold names it as stored)
    w, s = weights[0], scales[0]
    if w.dtype == "F8_E4M3" and s.dtype in ("F8_E8M0", "F32") and len(s.shape) == 2:
        return 2 * len(names), Members(names, w.shape, "block_fp8", ("weight", "scale"), [weights, scales])
    if w.dtype in ("I8", "U8") and len(w.shape) == 2 and s.dtype == "F8_E8M0" and not _mxfp4_shapes_misfit(w.shape, s.shape):
        return 2 * len(names), Members(names, (w.shape[0], w.shape[1] * 2), "fp4_packed", ("weight", "scale"),
                                       [weights, scales])
    return None


def group_stored(model: ModelMap, stored: dict[str, TensorEntry]) -> Grouped | None:
    """The buckets tensor_groups.group_tensors makes of fold(stored), made from the stored columns; None where this
    path does not take the checkpoint (see the module's docstring)."""
    if any(r.pattern.endswith(COMPANION_SUFFIXES) for p in model.parts for r in p.rules):
        return None
    buckets: list[Bucket] = []
    claimed: set[str] = set()  # names taken by groups of the rules that may overlap (as group_tensors keeps them)
    overlapping = may_overlap(model)
    alike = read_back_alike(model, overlapping)
    n_claimed, missing = 0, None
    for rule, layer, required, names in model.expected_groups():
        index = None
        shared = id(rule) in overlapping
        if shared and not claimed.isdisjoint(names):
            index = [i for i, n in enumerate(names) if n not in claimed]
            names = [names[i] for i in index]
            if not names:
                continue
        found = _group_members(names, stored)
        if found is None:
            return None
        count, members = found
        if members is None:
            if required and missing is None:
                missing = names[0]
            continue
        if id(rule) not in alike:
            info = model.classify(names[0])
            if info is None or info.rule is not rule or info.layer != layer:
                return None  # the manifest reads these names otherwise: the per-name path classifies them
        if shared:
            claimed.update(names)
        n_claimed += count
        experts = list(range(len(names)) if index is None else index) if "{E}" in rule.pattern else [None] * len(names)
        buckets.append(Bucket(rule, layer, names, experts, members))
    if n_claimed != len(stored):  # a tensor no group took (unknown, an orphan companion): the per-name path names it
        return None
    return Grouped(buckets, [], missing)
