"""Preallocated per-layer decode cache: MLA latent (kv_lora_rank) + rope key + DSA indexer key per token.
Never expanded per head: decode attends over the latent directly (absorbed form)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import TextConfig


@dataclass
class LayerCache:
    latent: torch.Tensor  # [B, max_len, kv_lora_rank]
    k_rope: torch.Tensor  # [B, max_len, qk_rope_head_dim]
    index_k: torch.Tensor | None  # [B, max_len, index_head_dim]


class KVCache:
    def __init__(self, cfg: TextConfig, batch: int, max_len: int, dtype: torch.dtype, device="cpu"):
        self.max_len, self.length, self.batch = max_len, 0, batch

        def buf(width):
            return torch.zeros(batch, max_len, width, dtype=dtype, device=device)

        self.layers = [LayerCache(buf(cfg.kv_lora_rank), buf(cfg.qk_rope_head_dim),
                                  buf(cfg.index_head_dim) if cfg.index_topk else None) for _ in range(cfg.num_layers)]

    def nbytes(self) -> int:
        n = 0
        for l in self.layers:
            for t in (l.latent, l.k_rope, l.index_k):
                if t is not None:
                    n += t.numel() * t.element_size()
        return n

    def reset(self) -> None:
        self.length = 0
