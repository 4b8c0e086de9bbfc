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

from typing import NamedTuple

from kconvert.family.manifest import ModelMap, Rule, TensorInfo
from kconvert.errors import ManifestError
from kconvert.source.logical import LogicalTensor, stored_alike, stored_form
from kconvert.source.stored_parts import check_scale_shape

FLOAT_TAGS = ("F16", "BF16", "F32", "F64")
TABLE_TAGS = ("I64", "I32")  # integer lookup tables the manifest names (`values_below`: V4's tid2eid)


class Bucket(NamedTuple):
    """Tensors of one (rule, layer) stored alike; `sample` is the first, `experts` theirs (None: no experts)."""

    rule: Rule
    layer: int | None
    names: list[str]
    experts: list[int | None]
    sample: LogicalTensor

    @property
    def info(self) -> TensorInfo:
        return TensorInfo(self.names[0], self.rule, self.layer, self.experts[0])

    def earliest(self, pos: dict[str, int]) -> TensorInfo:
        """The member stored first (`pos`: name -> stored position): where a walk in stored order meets the bucket."""
        at = list(map(pos.__getitem__, self.names))
        i = at.index(min(at))
        return TensorInfo(self.names[i], self.rule, self.layer, self.experts[i])


class Grouped(NamedTuple):
    buckets: list[Bucket]  # every tensor the manifest knows, once
    rest: list[str]  # present names the manifest does not know, in stored order
    missing: str | None  # the first required name absent (model order), for the caller to report last


def group_tensors(model: ModelMap, logical: dict[str, LogicalTensor]) -> Grouped:
    buckets: list[Bucket] = []
    claimed: set[str] = set()
    n_claimed, missing = 0, None
    get = logical.get
    for rule, layer, required, names in model.expected_groups():
        index = None  # each name's expert number, where an earlier rule took some of the names
        if not claimed.isdisjoint(names):  # an earlier rule generates these too: classify keeps the first
            index = [i for i, n in enumerate(names) if n not in claimed]
            names = [names[i] for i in index]
        found = list(map(get, names))
        absent = found.count(None)
        if absent and required and missing is None:
            missing = names[found.index(None)]
        if absent == len(names):
            continue
        first = 0 if found[0] is not None else next(i for i, t in enumerate(found) if t is not None)
        info = model.classify(names[first])
        if info is None or info.rule is not rule or info.layer != layer:
            continue  # the manifest reads these names otherwise: the one-by-one path classifies them
        claimed.update(names)
        n_claimed += len(names) - absent
        at = [i for i, t in enumerate(found) if t is not None] if absent else range(len(names))
        tensors = [found[i] for i in at] if absent else found
        experts = ([i if index is None else index[i] for i in at] if "{E}" in rule.pattern else [None] * len(at))
        if stored_alike(tensors):  # the usual case: every expert of a layer stored alike
            buckets.append(Bucket(rule, layer, [names[i] for i in at] if absent else names, experts, tensors[0]))
            continue
        by_form: dict[tuple, Bucket] = {}
        for i, form, t, e in zip(at, map(stored_form, tensors), tensors, experts):
            b = by_form.get(form)
            if b is None:
                b = by_form[form] = Bucket(rule, layer, [], [], t)
            b.names.append(names[i])
            b.experts.append(e)
        buckets.extend(by_form.values())
    rest = []
    for name in [] if n_claimed == len(logical) else [n for n in logical if n not in claimed]:
        info = model.classify(name)
        if info is None:
            rest.append(name)
        else:
            buckets.append(Bucket(info.rule, info.layer, [name], [info.expert], logical[name]))
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
