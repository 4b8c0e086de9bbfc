"""Greedy speculative decoding with the model's draft heads (engine/draft/drafter.py).

A round: the drafter proposes k tokens after the last token t; the target runs [t, d1..dk] in one forward
(its cache marked first) and its greedy choice at every position is known at once; the longest prefix of
drafts it agrees with is kept, plus its own next token (so every round yields 1..k+1 tokens); the target's
cache goes back to the kept tokens (`rollback`: the paged MLA cache drops rows, DeepSeek-V4's rebuilds its
rings and compressor state from the mark), and the drafter reads the kept positions with the target's own
hidden states. Every token is the target's greedy choice, so the output is plain greedy decoding's, token
for token (up to round-off between a k+1-token forward and k+1 one-token forwards: none in float32 on the
tested models). k = the number of draft heads by default (1 for DeepSeek-V3 / V3.2 / K2 / V4), or any
count by chained re-use of the first head.

Stats: drafts proposed and accepted at each draft position (`per_depth`: position 0 is the first draft
of a round, the head's own next-token prediction), target forwards after the prefill (`steps`), tokens
per target step."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from engine.draft.drafter import new_drafter
from engine.runtime.generate import Result, Sampling
from kconvert.errors import EngineError, UsageError


@dataclass
class SpecStats:
    proposed: list[int] = field(default_factory=list)  # per draft position: drafts proposed
    accepted: list[int] = field(default_factory=list)  # per draft position: drafts the target agreed with
    steps: int = 0  # target forwards after the prefill
    tokens: int = 0  # tokens those forwards produced

    def add(self, k: int, m: int) -> None:
        while len(self.proposed) < k:
            self.proposed.append(0)
            self.accepted.append(0)
        for j in range(k):
            self.proposed[j] += 1
            self.accepted[j] += j < m

    @property
    def acceptance(self) -> float:
        """Accepted drafts / proposed drafts (0 when none were proposed)."""
        n = sum(self.proposed)
        return sum(self.accepted) / n if n else 0.0

    @property
    def per_depth(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted, self.proposed)]

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0

    def to_json(self) -> dict:
        return {"acceptance": self.acceptance, "per_depth": self.per_depth, "proposed": self.proposed,
                "accepted": self.accepted, "target_steps": self.steps, "tokens_per_step": self.tokens_per_step}


@dataclass
class SpecResult(Result):
    stats: SpecStats = field(default_factory=SpecStats)


def _argmax(logits: torch.Tensor) -> list[int]:
    return logits.argmax(-1).tolist()


@torch.inference_mode()
def generate_speculative(model, prompt: list[int], p: Sampling, cache=None, image_embeds=None, on_token=None,
                         start: int = 0, kv=None, drafter=None, k: int | None = None) -> SpecResult:
    """generate()'s greedy output, drafted by `drafter` (default: new_drafter(model, k)) and verified in rounds.
    With a cache holding prompt[:start], `drafter` must be the one that followed it (a chat session's). Every
    rank runs this in lock-step; the drafter lives on the last stage (None elsewhere)."""
    if p.temperature > 0:
        raise UsageError("--speculative decodes greedily: it takes --temperature 0")
    if not prompt or start >= len(prompt):
        raise EngineError("empty prompt")
    par = model.par
    if drafter is None and start:
        raise EngineError("a cache holding a prompt needs the drafter that followed it")
    drafter = drafter if drafter is not None else new_drafter(model, k)
    k = (drafter.k if drafter is not None else 1) if k is None else k
    k = int(par.broadcast_object(k, src=par.last_rank)) if par.world > 1 else k
    cache = cache if cache is not None else model.new_cache(1, len(prompt) + p.max_new_tokens + k + 1, kv=kv)
    if len(prompt) > cache.max_len:
        raise EngineError(f"prompt of {len(prompt)} tokens exceeds the context of {cache.max_len} tokens")
    t0 = time.perf_counter()
    sampler = par.last_rank
    hidden: list = []
    logits = model.forward(torch.tensor([prompt[start:]]), cache, image_embeds=image_embeds, last_only=True,
                           everywhere=False, hidden=hidden)
    tok = _argmax(logits[0, -1].cpu()) if par.rank == sampler else None
    tok = par.broadcast_object(tok, src=sampler)
    ttft = time.perf_counter() - t0
    t1 = time.perf_counter()
    if drafter is not None:
        x = torch.cat(hidden, 1)
        if start:
            x = torch.cat([drafter.resume(start), x], 1)  # the last position again: the token after it may differ
        else:
            drafter.start(cache.max_len)
        drafter.extend(x, prompt[start + 1:] + [tok] if not start else prompt[start:] + [tok])
    tokens, stats, reason = [tok], SpecStats(), "length"
    budget = min(p.max_new_tokens, cache.max_len - cache.length + 1)
    if on_token:
        on_token(tok)
    if tok in p.stop_ids:
        return SpecResult(tokens, "stop", ttft, time.perf_counter() - t1, stats)
    while len(tokens) < budget:
        n0 = cache.length
        kk = max(0, min(k, budget - len(tokens) - 1, cache.max_len - n0 - 1))
        drafts = drafter.draft(kk) if drafter is not None else None
        drafts = par.broadcast_object(drafts, src=sampler) if par.world > 1 else drafts
        cache.mark()
        hidden = []
        logits = model.forward(torch.tensor([[tok] + drafts]), cache, everywhere=False, hidden=hidden)
        if par.rank == sampler:
            want = _argmax(logits[0].cpu())
            m = next((j for j, (d, w) in enumerate(zip(drafts, want)) if d != w), len(drafts))
            new = drafts[:m] + [want[m]]
        else:
            new = None
        new = par.broadcast_object(new, src=sampler) if par.world > 1 else new
        m = len(new) - 1
        if kk:
            stats.add(kk, m)
        kept = []
        for t in new:  # stop at a stop token or the budget, as generate() does
            kept.append(t)
            if t in p.stop_ids or len(tokens) + len(kept) >= budget:
                break
        cache.rollback(n0 + len(kept))  # the target holds t and the kept tokens but the last
        stats.steps += 1
        stats.tokens += len(kept)
        if drafter is not None:
            drafter.extend(torch.cat(hidden, 1)[:, :len(kept)], kept)
        for t in kept:
            tokens.append(t)
            if on_token:
                on_token(t)
        tok = kept[-1]
        if tok in p.stop_ids:
            reason = "stop"
            break
    return SpecResult(tokens, reason, ttft, time.perf_counter() - t1, stats)
