"""A checkpoint's logical tensors checked against its manifest a (rule, layer) at a time.

A released MoE checkpoint is 70k-200k tensors but a few thousand (rule, layer) groups: the 384 experts of a
layer share one rule, one expected shape and, in practice, one stored form. The manifest's names for each
group are generated (`ModelMap.expected_groups`) and looked up; the members of a group stored alike (format,
shape, every part's dtype and shape) form a bucket, checked once through its first member. A name no group
generates (written otherwise, e.g. `layers.05`) is classified on its own into a bucket of one, as is every
tensor of a group whose first name the manifest classifies otherwise. `inspect` and `plan` then count buckets,
not tensors.
"""

from __future__ import annotations

from itertools import chain
from typing import NamedTuple

from kconvert.family.manifest import ModelMap, Rule, TensorInfo
from kconvert.errors import ManifestError
from kconvert.source.logical import LogicalTensor, stored_alike, stored_form
from kconvert.source.stored_parts import check_scale_shape

FLOAT_TAGS = ("F16", "BF16", "F32", "F64")
TABLE_TAGS = ("I64", "I32")  # integer lookup tables the manifest names (`values_below`: V4's tid2eid)


class Bucket(NamedTuple):
    """Tensors of one (rule, layer) stored alike, with their names and experts (None: no experts)."""

    rule: Rule
    layer: int | None
    names: list[str]
    experts: list[int | None]  # all None (the rule has no {E}) or all experts
    tensors: list[LogicalTensor]

    @property
    def sample(self) -> LogicalTensor:
        """The first member: it stands for the bucket in every check (they are stored alike)."""
        return self.tensors[0]

    @property
    def info(self) -> TensorInfo:
        return TensorInfo(self.names[0], self.rule, self.layer, self.experts[0])

    def earliest(self, pos: dict[int, int]) -> tuple[int, TensorInfo]:
        """The member stored first and its place (`pos`: `stored_positions`): where a walk in stored order meets
        the bucket."""
        first = min(map(pos.__getitem__, map(id, self.tensors)))
        i = 0 if pos[id(self.tensors[0])] == first else list(map(pos.__getitem__, map(id, self.tensors))).index(first)
        return first, TensorInfo(self.names[i], self.rule, self.layer, self.experts[i])


def stored_positions(logical: dict[str, LogicalTensor]) -> dict[int, int]:
    """Each logical tensor's place in stored order, keyed by the tensor object's id: a bucket's members are found by
    int keys rather than by their names (generated strings, each compared character by character with the key)."""
    return dict(zip(map(id, logical.values()), range(len(logical))))


class Grouped(NamedTuple):
    buckets: list[Bucket]  # every tensor the manifest knows, once
    rest: list[str]  # present names the manifest does not know, in stored order
    missing: str | None  # the first required name absent (model order), for the caller to report last


def may_overlap(model: ModelMap) -> set[int]:
    """ids of the rules whose names another group may also generate: rules that share their name key with another
    rule (every name a pattern generates has the pattern's key, so a rule with a key of its own generates names no
    other rule does), and per-layer rules whose pattern names no layer (the same names for every layer)."""
    shared = {id(r) for rules in model.by_key.values() if len(rules) > 1 for r, _ in rules}
    return shared | {id(r) for p in model.parts for r in p.rules
                     if r.layers is not None and "{L}" not in r.pattern and "{M}" not in r.pattern}


def _between_dots(pattern: str) -> bool:
    """Whether every {L}, {E} and {M} of `pattern` stands between dots (or a dot and the end); when one placeholder
    follows another (`.{L}.{L}.`) it may say no, which only costs a classify per group."""
    dotted = pattern + "."
    return all(dotted.count(p) == dotted.count(f".{p}.") for p in ("{L}", "{E}", "{M}"))


def read_back_alike(model: ModelMap, overlapping: set[int]) -> set[int]:
    """ids of the rules whose generated names `classify` reads back as their own (rule, layer) without being asked: a
    name key no other rule shares, and every {L}/{E}/{M} between dots, so each name has the pattern's key and its
    numbers read back as generated (expected_groups yields only layers the rule names). The others are classified a
    group at a time."""
    return {id(r) for p in model.parts for r in p.rules if id(r) not in overlapping
            and _between_dots(r.pattern)}


def group_tensors(model: ModelMap, logical: dict[str, LogicalTensor]) -> Grouped:
    buckets: list[Bucket] = []
    claimed: set[str] = set()  # names taken by groups of the rules that may overlap (the others' cannot recur)
    overlapping = may_overlap(model)
    alike = read_back_alike(model, overlapping)
    n_claimed, missing = 0, None
    get = logical.get
    for rule, layer, required, names in model.expected_groups():
        index = None  # each name's expert number, where an earlier rule took some of the names
        shared = id(rule) in overlapping
        if shared and not claimed.isdisjoint(names):  # an earlier group generates these too: classify keeps the first
            index = [i for i, n in enumerate(names) if n not in claimed]
            names = [names[i] for i in index]
        found = list(map(get, names))
        absent = found.count(None)
        if absent and required and missing is None:
            missing = names[found.index(None)]
        if absent == len(names):
            continue
        if id(rule) not in alike:
            first = 0 if found[0] is not None else next(i for i, t in enumerate(found) if t is not None)
            info = model.classify(names[first])
            if info is None or info.rule is not rule or info.layer != layer:
                continue  # the manifest reads these names otherwise: the one-by-one path classifies them
        if shared:
            claimed.update(names)
        n_claimed += len(names) - absent
        at = [i for i, t in enumerate(found) if t is not None] if absent else range(len(names))
        tensors = [found[i] for i in at] if absent else found
        if "{E}" not in rule.pattern:
            experts = [None] * len(at)
        else:
            experts = list(at if index is None else map(index.__getitem__, at))
        if stored_alike(tensors):  # the usual case: every expert of a layer stored alike
            buckets.append(Bucket(rule, layer, [names[i] for i in at] if absent else names, experts, tensors))
            continue
        by_form: dict[tuple, Bucket] = {}
        for i, form, t, e in zip(at, map(stored_form, tensors), tensors, experts):
            b = by_form.get(form)
            if b is None:
                b = by_form[form] = Bucket(rule, layer, [], [], [])
            b.names.append(names[i])
            b.experts.append(e)
            b.tensors.append(t)
        buckets.extend(by_form.values())
    rest = []
    if n_claimed != len(logical):  # some names no group took: every bucket's names, then what is left
        claimed.update(chain.from_iterable(b.names for b in buckets))
    for name in [] if n_claimed == len(logical) else [n for n in logical if n not in claimed]:
        info = model.classify(name)
        if info is None:
            rest.append(name)
        else:
            buckets.append(Bucket(info.rule, info.layer, [name], [info.expert], [logical[name]]))
    return Grouped(buckets, rest, missing)


def check_tensor(t: LogicalTensor, info: TensorInfo, block: tuple[int, int], group: int) -> None:
    """One tensor against its manifest rule: a float (or an index table's integer) dtype, a scale grid that fits
    config.json's block or group size, the shape config.json implies."""
    name = info.name  # the name as the manifest knows it (a sidecar weight's own may be its stored one)
    if info.rule.values_below is not None:
        if t.format != "plain" or t.main.dtype not in TABLE_TAGS:
            raise ManifestError(f"stored as {t.main.dtype}: an index table must be I64 or I32",
                                file=str(t.main.file), tensor=name)
    elif t.format == "plain" and t.main.dtype not in FLOAT_TAGS:  # e.g. a header whose BF16 became I16
        raise ManifestError(f"stored as {t.main.dtype}: a model weight must be a float (F16, BF16, F32 or "
                            "F64), or FP8/INT8/INT4 with its scale", file=str(t.main.file), tensor=name)
    check_scale_shape(t, block, group)
    expect = info.expected_shape()
    if tuple(t.shape) != expect:
        raise ManifestError(f"shape {list(t.shape)} disagrees with config.json, which implies {list(expect)}",
                            file=str(t.main.file), tensor=name)
