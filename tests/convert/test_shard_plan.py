"""shard plans a validation bucket at a time (one rule and layer stored alike: a layer's 384 experts decided once per
expert group) and name by name only where a bucket's members are not decided alike. Both must give the very same
outputs, and where the bucket plan declines, plan_items must refuse exactly as the name-by-name plan does."""

from __future__ import annotations

import pytest

from kconvert.convert.layout import Layout
from kconvert.quant.policy import QuantPolicy
from kconvert.convert.shard.outputs import _specs, spec_suffixes
from kconvert.convert.shard.plan import _PerName, _Plan, plan_items
from kconvert.errors import UsageError
from kconvert.source.checkpoint import Checkpoint


def _outputs(items: dict) -> dict:
    return {key: sorted((o.src, tuple(o.info[:1]) + (o.info.rule.pattern,) + tuple(o.info[2:]), o.piece, o.transform,
                         o.shape, o.src_dtype, o.scale_format, o.group_size, o.int4_scales, o.copy) for o in w.outputs)
            for key, w in items.items()}


CASES = [  # (preset, fixture options, tp, ep, --quant, --requantize, keep MTP layers)
    ("tiny-k25-dsv32", {}, 2, None, "fp8", False, False),
    ("tiny-k25-dsv32-fp8", {}, 2, None, "fp8", False, False),  # lossless block copies
    ("tiny-k25-dsv32-fp8", {}, 4, None, "fp8", True, False),  # some slices cut inside a block: requantized
    ("tiny-k25-dsv32-int4", {}, 2, 1, "int8", False, False),  # every expert split over the ranks
    ("tiny-dsv32", {}, 2, None, "int4", False, True),
    ("tiny-dsv4-flash", {}, 2, None, "fp8", True, False),
    ("tiny-dsv4-flash", {}, 2, 1, "none", False, True),
    ("topo-k25", {"layers": 3, "experts": 16}, 4, 2, "fp8", False, False),  # 2 expert groups of 2 ranks
]


@pytest.mark.parametrize("preset,kw,tp,ep,quant,requantize,keep_mtp", CASES)
def test_bucket_plan_is_the_name_plan(checkpoint, preset, kw, tp, ep, quant, requantize, keep_mtp):
    ck = Checkpoint.open(checkpoint(preset, **kw))
    ck.validate()
    plan = _Plan(ck, Layout.make(tp, ep), QuantPolicy(quant), requantize, keep_mtp)
    by_name, misaligned, _ = plan.by_name()
    assert not misaligned
    by_bucket = plan.by_bucket()
    assert _outputs(by_bucket) == _outputs(by_name)
    # the specs the plan made by suffix (where names are the source's + a suffix) are the scheme's own
    outputs = [o for w in by_bucket.values() for o in w.outputs]
    made = [o for o in outputs if spec_suffixes(o.transform, o.shape, o.src_dtype, o.scale_format, o.group_size,
                                                o.int4_scales, o.fp8_block) is not None]
    assert made and all(o.specs() == _specs(o.src, o.transform, o.shape, o.src_dtype, o.options) for o in outputs)


@pytest.mark.parametrize("preset,tp,ep", [("tiny-k25-dsv32-fp8", 4, None), ("tiny-dsv4-flash", 2, 1)])
def test_a_bucket_the_plan_declines_is_refused_as_name_by_name(checkpoint, preset, tp, ep):
    """Slices cut inside a scale block (no --requantize): the bucket plan declines, and the refusal counts every
    such tensor and names the one a walk in stored order meets first."""
    ck = Checkpoint.open(checkpoint(preset))
    layout, policy = Layout.make(tp, ep), QuantPolicy("fp8")
    with pytest.raises(_PerName):
        _Plan(ck, layout, policy, False, True).by_bucket()
    _, misaligned, _ = _Plan(ck, layout, policy, False, True).by_name()  # draft heads kept, as plan_items does
    with pytest.raises(UsageError, match=f"cuts {misaligned[0]} \\(and {len(misaligned) - 1} more\\)"):
        plan_items(ck, layout, policy)
