"""The columnar path (source/stored_groups.py) gives the buckets the fold + group_tensors path gives, member for
member, on every stored form it takes; it takes the released forms (so inspect and plan never fold a release's
250k experts), and declines whatever it cannot vouch for, leaving the per-name path to name what is wrong."""

from __future__ import annotations

import pytest

from kconvert.source.checkpoint import Checkpoint
from kconvert.source.logical import fold, stored_form
from kconvert.source.logical_by_name import LogicalByName, parts_by_role
from kconvert.source.stored_groups import group_stored
from kconvert.source.tensor_groups import group_tensors

# (preset, fixture options, the stored forms it holds)
TAKEN = [("tiny-kimi-k3", {}, {"fp4_packed", "plain"}), ("tiny-k25-dsv32-int4", {}, {"int4_packed", "plain"}),
         ("tiny-k25-dsv32-fp8", {}, {"block_fp8", "plain"}), ("topo-k25", {"layers": 3, "experts": 8},
                                                              {"int4_packed", "plain"}),
         ("tiny-dsv4-flash", {}, {"block_fp8", "fp4_packed", "plain"}),
         ("topo-dsv4-pro", {"layers": 3, "experts": 8}, {"block_fp8", "fp4_packed", "plain"}),
         ("tiny-dsv41", {}, {"block_fp8", "fp4_packed", "plain"})]


def _view(grouped) -> list[tuple]:
    return [(b.rule.pattern, b.layer, b.names, b.experts, list(b.tensors)) for b in grouped.buckets]


@pytest.mark.parametrize("preset,kw,forms", TAKEN, ids=[p for p, _, _ in TAKEN])
def test_columns_give_the_folded_buckets(checkpoint, preset, kw, forms):
    ck = Checkpoint.open(checkpoint(preset, **kw))
    columnar = group_stored(ck.model, ck.stored)
    assert columnar is not None
    folded = group_tensors(ck.model, fold(ck.stored))
    assert _view(columnar) == _view(folded)  # every member, each LogicalTensor equal to fold's
    assert columnar.missing == folded.missing and not columnar.rest
    assert {b.sample.format for b in columnar.buckets} == forms
    assert ck._logical is None and ck.tensor_count == len(fold(ck.stored))  # validated without folding


@pytest.mark.parametrize("change", ["orphan scale", "partial group", "one expert bf16", "unknown name", "1-D packed",
                                    "a weight_shape"])
def test_what_the_columns_cannot_vouch_for_is_left_to_the_fold(checkpoint, change):
    ck = Checkpoint.open(checkpoint("tiny-kimi-k3"))
    stored = dict(ck.stored)
    packed = next(k for k in stored if k.endswith(".experts.2.w1.weight_packed"))
    if change == "orphan scale":
        del stored[packed]
    elif change == "partial group":
        del stored[packed], stored[packed.replace("_packed", "_scale")]
    elif change == "one expert bf16":
        e = stored.pop(packed)
        del stored[packed.replace("_packed", "_scale")]
        stored[packed.removesuffix("_packed")] = e._replace(dtype="BF16", shape=(e.shape[0], e.shape[1]))
    elif change == "1-D packed":  # every expert of the group alike, each packed tensor 1-D
        group = [k for k in stored if k.endswith(".w1.weight_packed") and ".layers.1." in k]
        assert group  # layer 1 has routed experts
        for k in group:
            stored[k] = stored[k]._replace(shape=(stored[k].shape[0] * stored[k].shape[1],))
    elif change == "a weight_shape":  # an INT4 companion beside an MXFP4 pair: fold reads it as INT4
        stored[packed.replace("_packed", "_shape")] = next(iter(stored.values()))
    else:
        stored["language_model.model.layers.0.mlp.odd.weight"] = next(iter(stored.values()))
    assert group_stored(ck.model, stored) is None


@pytest.mark.parametrize("preset,kw", [("tiny-kimi-k3", {}), ("topo-k25", {"layers": 3, "experts": 8}),
                                       ("tiny-dsv41", {})], ids=["kimi-k3", "topo-k25", "dsv41"])
def test_logical_by_name_is_the_fold(checkpoint, preset, kw):
    """Once validated from the columns, Checkpoint.logical answers name by name from the buckets: each tensor and
    each stack's stored parts are fold's, and walking it gives fold's dict in fold's order."""
    ck = Checkpoint.open(checkpoint(preset, **kw))
    ck.validate()
    folded = fold(ck.stored)
    by_name = ck.logical
    assert isinstance(by_name, LogicalByName) and len(by_name) == len(folded)
    names = list(folded)
    assert all(by_name[n] == folded[n] for n in names[::-1]) and by_name._folded is None
    assert "model.no.such.weight" not in by_name and by_name.get("model.no.such.weight") is None
    for t in folded.values():  # every stacked form, a stack of its tensors in reverse
        if t.format in ("plain", "fp4_packed", "int4_packed"):
            same = [n for n in names if stored_form(folded[n]) == stored_form(t)][::-1][:5]
            (t0, got), (f0, want) = by_name.columns(same), parts_by_role([folded[n] for n in same])
            assert t0 == f0 and list(got) == list(want) and all(got[r][0] == want[r][0] for r in got)
            assert {r: [e._replace(dtype=None) for e in es] for r, es in got.items()} == \
                {r: [e._replace(dtype=None) for e in es] for r, es in want.items()}  # (read as the first's dtype)
    assert list(by_name.items()) == list(folded.items())  # walked whole: folded once


def test_a_columnar_shard_never_folds(checkpoint, tmp_path, monkeypatch):
    """shard reads a release's experts as stacks from the stored columns: no LogicalTensor is folded for each
    (Kimi K3: 250k of them, a sixth of shard's work beyond its data); the files are the folded path's."""
    from helpers import shard_job
    from kconvert.convert.shard.job import shard
    from kconvert.source import checkpoint as checkpoint_module

    src = checkpoint("tiny-kimi-k3")
    with monkeypatch.context() as m:  # validated by the fold and group_tensors: Checkpoint.logical a folded dict
        m.setattr(checkpoint_module, "group_stored", lambda model, stored: None)
        shard(shard_job(src, tmp_path / "folded", tp=2, quant="fp8"))
    monkeypatch.setattr(checkpoint_module, "fold", lambda stored: pytest.fail("folded"))
    shard(shard_job(src, tmp_path / "columns", tp=2, quant="fp8"))
    files = sorted((tmp_path / "folded").rglob("*.safetensors"))
    assert files
    for f in files:
        assert f.read_bytes() == (tmp_path / "columns" / f.relative_to(tmp_path / "folded")).read_bytes()
