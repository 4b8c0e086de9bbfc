"""The columnar path (source/stored_groups.py) gives the buckets the fold + group_tensors path gives, member for
member, on every stored form it takes; it takes the released forms (so inspect and plan never fold a release's
250k experts), and declines whatever it cannot vouch for, leaving the per-name path to name what is wrong."""

from __future__ import annotations

import pytest

from kconvert.source.checkpoint import Checkpoint
from kconvert.source.logical import fold
from kconvert.source.stored_groups import group_stored
from kconvert.source.tensor_groups import group_tensors

# (preset, fixture options, the stored forms it holds)
TAKEN = [("tiny-kimi-k3", {}, {"fp4_packed", "plain"}), ("tiny-k25-dsv32-int4", {}, {"int4_packed", "plain"}),
         ("tiny-k25-dsv32-fp8", {}, {"block_fp8", "plain"}), ("topo-k25", {"layers": 3, "experts": 8},
                                                              {"int4_packed", "plain"}),
         ("tiny-dsv41", {}, None)]


def _view(grouped) -> list[tuple]:
    return [(b.rule.pattern, b.layer, b.names, b.experts, list(b.tensors)) for b in grouped.buckets]


@pytest.mark.parametrize("preset,kw,forms", TAKEN, ids=[p for p, _, _ in TAKEN])
def test_columns_give_the_folded_buckets(checkpoint, preset, kw, forms):
    ck = Checkpoint.open(checkpoint(preset, **kw))
    columnar = group_stored(ck.model, ck.stored)
    if forms is None:  # V4.1's `.scale` sidecars: not a form the columns take; validation folds as before
        assert columnar is None
        assert ck.tensor_count == len(ck.logical)
        return
    assert columnar is not None
    folded = group_tensors(ck.model, fold(ck.stored))
    assert _view(columnar) == _view(folded)  # every member, each LogicalTensor equal to fold's
    assert columnar.missing == folded.missing and not columnar.rest
    assert {b.sample.format for b in columnar.buckets} == forms
    assert ck._logical is None and ck.tensor_count == len(fold(ck.stored))  # validated without folding


@pytest.mark.parametrize("change", ["orphan scale", "partial group", "one expert bf16", "unknown name"])
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
    else:
        stored["language_model.model.layers.0.mlp.odd.weight"] = next(iter(stored.values()))
    assert group_stored(ck.model, stored) is None
