"""Distance between a converted model's next-token distributions and the reference's, in the
statistics llama.cpp's `--kl-divergence` reports (plus a few that localise errors).

Inputs per prompt: reference log-probs (full [T, V], or top-K ids/log-probs + log-mass of the rest),
the test model's log-probs [T, V], and the prompt's tokens (position t predicts token t + 1).
With a top-K reference, KLD is computed over K + 1 buckets (the K tokens and "everything else"):
a lower bound of the full KLD that is exact when the rest carries no mass.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch


@dataclass
class RefLogprobs:
    """Reference next-token log-probabilities for one prompt."""

    tokens: torch.Tensor  # [T] int64
    full: torch.Tensor | None = None  # [T, V] float32
    topk_ids: torch.Tensor | None = None  # [T, K] int64
    topk_logprobs: torch.Tensor | None = None  # [T, K] float32
    rest_logprob: torch.Tensor | None = None  # [T] float32: log(1 - sum of top-K probabilities)


@dataclass
class PositionStats:
    """Per-position arrays (concatenated over prompts) from which every summary is taken."""

    kld: torch.Tensor
    same_top1: torch.Tensor  # bool
    dp_next: torch.Tensor  # p_test(next) - p_ref(next), positions with a known next token
    nll_ref: torch.Tensor
    nll_test: torch.Tensor
    cosine: torch.Tensor
    max_abs_dlogprob: torch.Tensor


def compare(ref: RefLogprobs, test_logprobs: torch.Tensor) -> PositionStats:
    """Per-position statistics for one prompt. `test_logprobs` [T, V] (log_softmax of the logits)."""
    test = test_logprobs.to(torch.float64)
    T = test.shape[0]
    nxt = ref.tokens[1:T].to(torch.int64)
    if ref.full is not None:
        r = ref.full.to(torch.float64)
        kld = (r.exp() * (r - test)).sum(-1)
        same = r.argmax(-1) == test.argmax(-1)
        rc, tc = r - r.mean(-1, keepdim=True), test - test.mean(-1, keepdim=True)
        cosine = (rc * tc).sum(-1) / (rc.norm(dim=-1) * tc.norm(dim=-1)).clamp_min(1e-300)
        max_abs = (r - test).abs().amax(-1)
        ref_next = r[: T - 1].gather(1, nxt[:, None]).squeeze(1)
    else:
        ids = ref.topk_ids.to(torch.int64)
        r_top = ref.topk_logprobs.to(torch.float64)
        t_top = test.gather(1, ids)
        t_rest = torch.log1p(-t_top.exp().sum(-1).clamp(max=1 - 1e-12))
        r_rest = ref.rest_logprob.to(torch.float64)
        kld = (r_top.exp() * (r_top - t_top)).sum(-1) + r_rest.exp() * (r_rest - t_rest)
        same = ids[:, 0] == test.argmax(-1)
        rc, tc = r_top - r_top.mean(-1, keepdim=True), t_top - t_top.mean(-1, keepdim=True)
        cosine = (rc * tc).sum(-1) / (rc.norm(dim=-1) * tc.norm(dim=-1)).clamp_min(1e-300)
        max_abs = (r_top - t_top).abs().amax(-1)
        # next-token reference log-prob: from the top-K when present, else unknown (excluded)
        hit = ids[: T - 1] == nxt[:, None]
        ref_next = torch.where(hit.any(1), (r_top[: T - 1] * hit).sum(1), torch.full((T - 1,), float("nan"),
                                                                                      dtype=torch.float64))
    test_next = test[: T - 1].gather(1, nxt[:, None]).squeeze(1)
    known = ~torch.isnan(ref_next)
    return PositionStats(kld=kld.clamp_min(0), same_top1=same, dp_next=(test_next.exp() - ref_next.exp())[known],
                         nll_ref=-ref_next[known], nll_test=-test_next[known], cosine=cosine, max_abs_dlogprob=max_abs)


def concat(parts: list[PositionStats]) -> PositionStats:
    return PositionStats(**{f: torch.cat([getattr(p, f) for p in parts]) for f in PositionStats.__dataclass_fields__})


@dataclass
class Summary:
    positions: int
    mean_kld: float
    median_kld: float
    p99_kld: float
    p999_kld: float
    max_kld: float
    same_top1_pct: float
    rms_dp_pct: float
    mean_cosine: float
    max_abs_dlogprob: float
    ppl_ratio: float

    def to_json(self) -> dict:
        return asdict(self)


def summarize(s: PositionStats) -> Summary:
    k = s.kld.to(torch.float64)
    q = lambda p: float(torch.quantile(k, p)) if k.numel() else float("nan")  # noqa: E731
    ppl_ratio = math.exp(float(s.nll_test.mean() - s.nll_ref.mean())) if s.nll_ref.numel() else float("nan")
    return Summary(
        positions=int(k.numel()), mean_kld=float(k.mean()), median_kld=q(0.5), p99_kld=q(0.99), p999_kld=q(0.999),
        max_kld=float(k.max()), same_top1_pct=100.0 * float(s.same_top1.double().mean()),
        rms_dp_pct=100.0 * float(s.dp_next.pow(2).mean().sqrt()) if s.dp_next.numel() else float("nan"),
        mean_cosine=float(s.cosine.mean()), max_abs_dlogprob=float(s.max_abs_dlogprob.max()), ppl_ratio=ppl_ratio,
    )


def topk_reference(tokens: torch.Tensor, logprobs: torch.Tensor, k: int) -> RefLogprobs:
    """Compress full reference log-probs to the top K + the log-mass of the rest."""
    lp = logprobs.to(torch.float32)
    vals, ids = lp.topk(k, dim=-1)
    rest = torch.log1p(-vals.double().exp().sum(-1).clamp(max=1 - 1e-12)).float()
    return RefLogprobs(tokens=tokens, topk_ids=ids, topk_logprobs=vals, rest_logprob=rest)
