"""Per-layer decode cache: MLA latent (kv_lora_rank) + rope key + DSA indexer key per token.
Never expanded per head: decode attends over the latent directly (absorbed form).

`max_len` is the limit, not the allocation: the buffers hold `reserve` tokens at first and grow (doubling,
up to `max_len`) as tokens arrive, so a config promising a 1M context does not allocate for 1M."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import TextConfig
from kconvert.errors import EngineError

MIN_GROWTH = 256  # tokens: growing one token at a time would copy the cache on every decode step


@dataclass
class LayerCache:
    latent: torch.Tensor  # [B, capacity, kv_lora_rank]
    k_rope: torch.Tensor  # [B, capacity, qk_rope_head_dim]
    index_k: torch.Tensor | None  # [B, capacity, index_head_dim]


class KVCache:
    def __init__(self, cfg: TextConfig, batch: int, max_len: int, dtype: torch.dtype, device="cpu",
                 reserve: int | None = None):
        self.cfg, self.dtype, self.device = cfg, dtype, device
        self.max_len, self.length, self.batch = max_len, 0, batch
        self.capacity = 0
        self.layers: list[LayerCache] = []
        self.ensure(max_len if reserve is None else min(reserve, max_len))

    def ensure(self, tokens: int) -> None:
        """Make room for `tokens` tokens (keeping what is cached); at most max_len."""
        if tokens > self.max_len:
            raise EngineError(f"sequence of {tokens} tokens exceeds the cache ({self.max_len} tokens)")
        if tokens <= self.capacity and self.layers:
            return
        # the first allocation is exact (a one-shot prompt knows its size); later ones leave room to grow
        new = tokens if self.capacity == 0 else min(self.max_len, max(tokens, 2 * self.capacity, MIN_GROWTH))
        c, keep = self.cfg, self.length

        def buf(old, width):
            t = torch.zeros(self.batch, new, width, dtype=self.dtype, device=self.device)
            if old is not None and keep:
                t[:, :keep] = old[:, :keep]
            return t

        olds = self.layers or [LayerCache(None, None, None)] * c.num_layers
        self.layers = [LayerCache(buf(o.latent, c.kv_lora_rank), buf(o.k_rope, c.qk_rope_head_dim),
                                  buf(o.index_k, c.index_head_dim) if c.index_topk else None) for o in olds]
        self.capacity = new

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for l in self.layers
                   for t in (l.latent, l.k_rope, l.index_k) if t is not None)

    def reset(self) -> None:
        self.length = 0
