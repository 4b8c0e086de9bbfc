"""The llama.cpp-style statistics of `kconvert verify`, against independent computations."""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

from kconvert.verify.kld import RefLogprobs, compare, concat, summarize, topk_reference


def _pair(seed: int, T=40, V=300, noise=0.3):
    g = torch.Generator().manual_seed(seed)
    ref_logits = torch.randn(T, V, generator=g) * 3
    test_logits = ref_logits + noise * torch.randn(T, V, generator=g)
    tokens = torch.randint(0, V, (T,), generator=g)
    return tokens, ref_logits.log_softmax(-1), test_logits.log_softmax(-1)


def test_full_reference_statistics_match_independent_formulas():
    seed = int.from_bytes(os.urandom(4), "little")
    tokens, r, t = _pair(seed)
    s = summarize(compare(RefLogprobs(tokens=tokens, full=r), t))
    kld = F.kl_div(t.double(), r.double(), log_target=True, reduction="none").sum(-1)
    assert math.isclose(s.mean_kld, float(kld.mean()), rel_tol=1e-9), seed
    assert math.isclose(s.max_kld, float(kld.max()), rel_tol=1e-9)
    assert math.isclose(s.p99_kld, float(torch.quantile(kld, 0.99)), rel_tol=1e-9)
    assert math.isclose(s.same_top1_pct, 100 * float((r.argmax(-1) == t.argmax(-1)).double().mean()))
    dp = [math.exp(t[i, tokens[i + 1]]) - math.exp(r[i, tokens[i + 1]]) for i in range(len(tokens) - 1)]
    assert math.isclose(s.rms_dp_pct, 100 * math.sqrt(sum(d * d for d in dp) / len(dp)), rel_tol=1e-6)
    nll_r = -sum(float(r[i, tokens[i + 1]]) for i in range(len(tokens) - 1)) / (len(tokens) - 1)
    nll_t = -sum(float(t[i, tokens[i + 1]]) for i in range(len(tokens) - 1)) / (len(tokens) - 1)
    assert math.isclose(s.ppl_ratio, math.exp(nll_t) / math.exp(nll_r), rel_tol=1e-6)
    cos = F.cosine_similarity(r - r.mean(-1, keepdim=True), t - t.mean(-1, keepdim=True), dim=-1)
    assert math.isclose(s.mean_cosine, float(cos.mean()), rel_tol=1e-5)


def test_identical_distributions_give_zero():
    tokens, r, _ = _pair(1)
    s = summarize(compare(RefLogprobs(tokens=tokens, full=r), r.clone()))
    assert s.mean_kld < 1e-12 and s.same_top1_pct == 100 and s.rms_dp_pct < 1e-9 and abs(s.ppl_ratio - 1) < 1e-12


def test_topk_reference_is_a_lower_bound_and_tight_when_peaked():
    tokens, r, t = _pair(2, noise=0.5)
    full = summarize(compare(RefLogprobs(tokens=tokens, full=r), t))
    k = summarize(compare(topk_reference(tokens, r, 16), t))
    assert k.mean_kld <= full.mean_kld + 1e-6
    assert k.same_top1_pct == full.same_top1_pct
    peaked = (r * 20).log_softmax(-1)  # nearly all mass in the top 16
    noise = torch.randn(peaked.shape, generator=torch.Generator().manual_seed(5))
    tp = (peaked + 0.05 * noise).log_softmax(-1)
    a = summarize(compare(RefLogprobs(tokens=tokens, full=peaked), tp)).mean_kld
    b = summarize(compare(topk_reference(tokens, peaked, 16), tp)).mean_kld
    assert b <= a + 1e-6 and a - b <= 0.01 * a + 1e-6  # the reference is stored in float32


def test_concat_pools_positions_across_prompts():
    parts = [compare(RefLogprobs(tokens=tk, full=r), t) for tk, r, t in (_pair(3, T=10), _pair(4, T=30))]
    assert summarize(concat(parts)).positions == 40


def test_non_finite_statistics_fail():
    """NaN compares false against every limit: without an explicit check, all-NaN metrics would PASS."""
    from kconvert.verify.verdict import compare as check_against

    tokens, r, _ = _pair(6)
    nan = torch.full_like(r, float("nan"))
    prompts = [{"kind": "short"}]
    limits = {"mean_kld": 1.0, "p99_kld": 10.0, "same_top1_pct": 0.0, "ppl_ratio": 100.0}
    bad = check_against(prompts, [RefLogprobs(tokens=tokens, full=r)], {"prompt.0.logprobs": nan}, limits, "ref", True)
    assert bad.verdict == "FAIL" and any("nan" in f for f in bad.failures), bad.failures
    good = check_against(prompts, [RefLogprobs(tokens=tokens, full=r)], {"prompt.0.logprobs": r}, limits, "ref", True)
    assert good.verdict == "PASS" and not good.failures


def test_first_fault_skips_a_layer_where_only_isolated_positions_depart():
    """A DSA near-tie decided the other way moves one position in one layer: not a fault there. A damaged
    tensor moves many positions (or gives NaN): that layer is named."""
    import torch

    from kconvert.verify.verdict import first_fault, layer_curve

    g = torch.Generator().manual_seed(0)
    ref = {f"prompt.0.hidden.{L}": torch.randn(600, 3, 32, generator=g) for L in range(3)}  # [T, streams, H]
    ref["prompt.0.hidden.3"] = torch.randn(600, 32, generator=g)  # the final norm: one stream
    meta = {"prompts": [{"id": "p"}]}
    got = {k: v.clone() for k, v in ref.items()}
    got["prompt.0.hidden.1"][155] += 0.5  # one position departs after layer 0 ...
    got["prompt.0.hidden.2"][155] += 0.5
    got["prompt.0.hidden.2"][200] += 0.5  # ... and one more after layer 1
    assert first_fault(layer_curve(meta, ref, got), None) == (None, None)
    got["prompt.0.hidden.3"][300:320] += 0.5  # 20 positions after layer 2: a fault
    assert first_fault(layer_curve(meta, ref, got), None) == ("layer 2", 2)
    got["prompt.0.hidden.2"][7, 1, 3] = float("nan")
    assert first_fault(layer_curve(meta, ref, got), None) == ("layer 1", 1)
