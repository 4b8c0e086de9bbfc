"""Generation: prefill + incremental decode over the latent cache; greedy / temperature / top-k / top-p
sampling, stop tokens, a seed; time to first token and decode tokens/s."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from kconvert.errors import EngineError


@dataclass
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    stop_ids: set = field(default_factory=set)
    seed: int | None = None


@dataclass
class Result:
    tokens: list[int]
    stop_reason: str  # "stop" | "length"
    ttft_s: float
    decode_s: float

    @property
    def tokens_per_s(self) -> float:
        n = len(self.tokens) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0


def sample(logits: torch.Tensor, p: Sampling, gen: torch.Generator | None) -> int:
    """One token id from logits [V]."""
    if p.temperature <= 0:
        return int(logits.argmax())
    logits = logits.float() / p.temperature
    if p.top_k and p.top_k < logits.numel():
        kth = logits.topk(p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if p.top_p < 1.0:
        sp, si = probs.sort(descending=True)
        drop = sp.cumsum(-1) - sp > p.top_p  # keep the smallest prefix whose mass reaches top_p
        sp = sp.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, si, sp)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=gen))


def generate(model, prompt: list[int], p: Sampling, cache=None, image_embeds=None, on_token=None,
             start: int = 0, kv=None) -> Result:
    """Generate after `prompt`; with a cache holding prompt[:start] already, only prompt[start:] is prefilled.
    Without a cache one is made with KV options `kv` (engine.cache.latent.KVOptions; default: the model's).
    `on_token(id)` is called as each token is chosen. Every rank runs this in lock-step under torchrun."""
    if not prompt or start >= len(prompt):
        raise EngineError("empty prompt")
    cache = cache if cache is not None else model.new_cache(1, len(prompt) + p.max_new_tokens, kv=kv)
    if len(prompt) > cache.max_len:
        raise EngineError(f"prompt of {len(prompt)} tokens exceeds the context of {cache.max_len} tokens")
    cache.ensure(min(cache.max_len, len(prompt) + p.max_new_tokens))
    gen = torch.Generator().manual_seed(p.seed) if p.seed is not None else None
    t0 = time.perf_counter()
    # the last stage samples (it alone has the logits under pp) and tells every rank the token
    sampler = model.par.last_rank
    logits = model.forward(torch.tensor([prompt[start:]]), cache, image_embeds=image_embeds, last_only=True,
                           everywhere=False)
    tokens, reason = [], "length"
    ttft = 0.0
    budget = min(p.max_new_tokens, cache.max_len - cache.length + 1)
    for i in range(budget):
        tok = sample(logits[0, -1].cpu(), p, gen) if model.par.rank == sampler else None
        tok = model.par.broadcast_object(tok, src=sampler)
        if i == 0:
            ttft = time.perf_counter() - t0
            t1 = time.perf_counter()
        tokens.append(tok)
        if on_token:
            on_token(tok)
        if tok in p.stop_ids:
            reason = "stop"
            break
        if i + 1 < budget:
            logits = model.forward(torch.tensor([[tok]]), cache, last_only=True, everywhere=False)
    return Result(tokens, reason, ttft, time.perf_counter() - t1 if tokens else 0.0)
