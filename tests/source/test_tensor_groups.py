"""Validation and counting a (rule, layer) bucket at a time (source/tensor_groups.py) give what a walk of every
tensor gives: the same inspect summary and plan groups, and on a damaged checkpoint the same error, the one a
walk in stored order meets first. The walk here is written out independently (classify each name, check it,
then look for absent required names); damage is drawn at random, in memory, from the headers a fixture has."""

from __future__ import annotations

import random
from collections import defaultdict

import pytest

from kconvert.errors import KConvertError
from kconvert.inspect.checkpoint import summarize
from kconvert.plan.rank_bytes import checkpoint_groups
from kconvert.source.checkpoint import Checkpoint
from kconvert.source.tensor_groups import check_tensor

PRESETS = [("topo-k25", {"layers": 3, "experts": 8}), ("topo-dsv4-pro", {"layers": 3, "experts": 8}),
           ("tiny-k25-dsv32-fp8", {}), ("tiny-dsv4-flash", {}), ("tiny-k25-dsv4", {})]


def _reopened(ck: Checkpoint, stored: dict) -> Checkpoint:
    """`ck` with its stored tensors replaced (headers edited in memory: validation never reads data)."""
    return Checkpoint(ck.root, ck.config, ck.files, stored, source=ck.source)


def _walk_error(ck: Checkpoint) -> str | None:
    """The error a tensor-by-tensor walk reports first, or None."""
    try:
        for name, t in ck.logical.items():
            info = ck.model.classify(name)
            if info is None:
                return f"{name}: tensor not known"
            check_tensor(t, info, ck.quant_block(), ck.int4_group())
        for info, required in ck.model.expected():
            if required and info.name not in ck.logical:
                return f"{info.name}: required"
    except KConvertError as e:
        return f"{e.tensor}: {e.message}"
    return None


def _walk_summary(ck: Checkpoint) -> tuple[dict, dict]:
    params, formats = defaultdict(int), defaultdict(lambda: [0, 0, 0])
    for name, t in ck.logical.items():
        params[ck.model.classify(name).component] += t.numel
        row = formats[(t.format, t.stored_dtype)]
        row[0], row[1], row[2] = row[0] + 1, row[1] + t.numel, row[2] + t.stored_bytes
    return dict(params), {k: tuple(v) for k, v in formats.items()}


def _groups(ck: Checkpoint) -> list[tuple]:
    return sorted((g.info.rule.pattern, g.shape, g.itemsize, g.experts, g.copies, g.layers)
                  for g in checkpoint_groups(ck))


@pytest.mark.parametrize("preset,kw", PRESETS, ids=[p for p, _ in PRESETS])
def test_bucketed_summary_matches_a_walk_of_every_tensor(checkpoint, preset, kw):
    ck = Checkpoint.open(checkpoint(preset, **kw))
    s = summarize(ck)
    params, formats = _walk_summary(ck)
    assert {c: n for c, n in s.params.items()} == params
    assert {(r["format"], r["dtype"]): (r["tensors"], r["params"], r["bytes"]) for r in s.formats} == formats
    assert s.tensors == len(ck.logical) == sum(len(b.names) for b in ck.grouped.buckets) + len(ck.grouped.rest)
    assert not ck.grouped.rest  # every name of a valid release is one the manifest generates
    assert all(ck.info(n) == ck.model.classify(n) for n in ck.logical)  # the infos shard asks for, from buckets
    # one expert stored otherwise (bf16 among INT4 / FP4, f32 among bf16): its own bucket, counted as such
    name, t = next((n, t) for n, t in ck.logical.items() if ".experts.3." in n)
    stored = {k: e for k, e in ck.stored.items() if not k.startswith(name.rsplit(".", 1)[0] + ".")}
    e, dtype = t.main, "BF16" if t.format != "plain" else "F32"
    stored[name] = e._replace(name=name, dtype=dtype, shape=t.shape, end=e.begin + (2 if dtype == "BF16" else 4) * t.numel)
    mixed = _reopened(ck, stored)
    s = summarize(mixed)
    params, formats = _walk_summary(mixed)
    assert s.params == params and sum(r["tensors"] for r in s.formats if r["format"] == "plain") == \
        sum(v[0] for k, v in formats.items() if k[0] == "plain")
    assert {(r["format"], r["dtype"]): (r["tensors"], r["params"], r["bytes"]) for r in s.formats} == formats


def test_plan_groups_match_groups_of_every_tensor(checkpoint):
    """checkpoint_groups from buckets == the same collapse fed one tensor at a time (an earlier version's way)."""
    from kconvert.io.dtypes import ITEMSIZE
    from kconvert.plan.rank_bytes import _collapse

    for preset, kw in PRESETS[:2]:
        ck = Checkpoint.open(checkpoint(preset, **kw))
        walk = _collapse([(info, t.shape, ITEMSIZE[t.main.dtype] if t.format == "plain" else 2,
                           [] if info.expert is None else [info.expert])
                          for name, t in ck.logical.items() for info in (ck.model.classify(name),)])
        assert _groups(ck) == sorted((g.info.rule.pattern, g.shape, g.itemsize, g.experts, g.copies, g.layers)
                                     for g in walk)


def test_plan_groups_do_not_depend_on_the_order_tensors_are_stored_in(checkpoint):
    """plan's groups come in model order, the order a plan from config.json alone has: the same groups, each named
    by the same tensor, when the files list their tensors reversed or sorted by name (experts 0, 1, 10, ...)."""
    def groups(c: Checkpoint) -> list[tuple]:
        return [(g.info.name, g.info.layer, g.info.expert, g.shape, g.itemsize, g.experts, g.copies, g.layers)
                for g in checkpoint_groups(c)]

    ck = Checkpoint.open(checkpoint("topo-k25", layers=3, experts=8))
    names, base = list(ck.stored), groups(ck)
    for order in (names[::-1], sorted(names)):
        assert groups(_reopened(ck, {n: ck.stored[n] for n in order})) == base


def _damage(rng: random.Random, ck: Checkpoint, stored: dict) -> None:
    """One random fault in one random stored tensor: renamed out of the manifest, removed, reshaped, retyped."""
    key = rng.choice(sorted(stored))
    e = stored[key]
    kind = rng.choice(["rename", "remove", "reshape", "retype"])
    if kind == "rename":
        stored[key.replace(".weight", ".wieght")] = stored.pop(key)
    elif kind == "remove" and not key.endswith(("_scale", "_shape", ".scale", "_scale_inv")):
        del stored[key]
    elif kind == "reshape" and e.shape:
        stored[key] = e._replace(shape=(e.shape[0] + 1,) + e.shape[1:])
    elif e.dtype in ("BF16", "F32"):
        stored[key] = e._replace(dtype="I16" if e.dtype == "BF16" else "I32")


DAMAGED = PRESETS[:2] + PRESETS[3:4] + [("tiny-kimi-k3", {})]  # K3: MXFP4 pairs, validated from stored columns


@pytest.mark.parametrize("preset,kw", DAMAGED, ids=[p for p, _ in DAMAGED])
def test_damaged_checkpoints_get_the_error_a_walk_meets_first(checkpoint, preset, kw):
    ck = Checkpoint.open(checkpoint(preset, **kw))
    rng = random.Random(20261202)
    seen = 0
    for _ in range(60):
        stored = dict(ck.stored)
        for _ in range(rng.choice([1, 2, 3])):
            _damage(rng, ck, stored)
        try:
            damaged = _reopened(ck, stored)  # folding refuses some damage itself: the same code either way
        except KConvertError:
            continue
        want = _walk_error(damaged)
        try:
            damaged.validate()
            got = None
        except KConvertError as e:
            got = f"{e.tensor}: {e.message}"
        assert (got is None) == (want is None) and (got or "").startswith(want.split(": ")[0] if want else ""), \
            (got, want)
        if want and want.endswith(("tensor not known", "required")):
            assert got.split(": ", 1)[1].startswith(("tensor not known", "required")), (got, want)
        elif want:
            assert got == want
        seen += want is not None
    assert seen >= 8  # enough draws damage something the manifest sees (folding refuses others first)



def test_rules_outside_may_overlap_generate_names_no_other_group_does():
    """group_tensors keeps no record of the names of rules with a name key of their own. That rests on every name
    a rule generates having the rule's key (so two rules can share a name only if they share a key), checked on
    every group of every example config; and on no name there coming from two groups unless both rules overlap."""
    import json

    from kconvert.family.families import manifests_dir
    from kconvert.family.manifest import bind, name_key
    from kconvert.source.tensor_groups import may_overlap

    overlaps = {}
    for config in sorted((manifests_dir() / "examples").glob("*/config.json")):
        model = bind(json.loads(config.read_text()))
        overlapping, seen = may_overlap(model), {}
        for rule, layer, _, names in model.expected_groups():
            ends = {name_key(names[0]), name_key(names[-1])}  # the names differ only in their numbers
            assert ends == {name_key(rule.pattern)}, (config.parent.name, rule.pattern, layer)
            for n in names:
                seen.setdefault(n, []).append(rule)
        shared = [rules for rules in seen.values() if len(rules) > 1]
        assert all(id(r) in overlapping for rules in shared for r in rules), config.parent.name
        overlaps[config.parent.name] = bool(overlapping)
    # most examples do share keys (V4's two gates, Kimi's projector); DeepSeek-V4.1's rules all differ in their keys
    assert {name for name, shares in overlaps.items() if not shares} == {"deepseek-v41-flash"}, overlaps


def test_read_back_alike_leaves_out_shared_keys_and_numbers_not_between_dots():
    """A rule sharing its key with another, or with a number not between dots (whose name keys differ from layer to
    layer, so `classify` may not find the rule), is classified a group at a time."""
    from types import SimpleNamespace

    from kconvert.source.tensor_groups import read_back_alike

    rules = [SimpleNamespace(pattern=p) for p in ("m.layers.{L}.mlp.experts.{E}.w1.weight", "m.layers.{L}.norm",
                                                  "m.layers.{L}a.norm", "{L}.norm", "m.h{E}.weight", "m.gate.weight")]
    model = SimpleNamespace(parts=[SimpleNamespace(rules=rules)])
    alike = read_back_alike(model, overlapping={id(rules[1])})
    assert [id(r) in alike for r in rules] == [True, False, False, False, False, True]
