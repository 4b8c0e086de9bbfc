"""DSA lightning indexer (DeepSeek-V3.2): picks the top-`index_topk` earlier keys for every query."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import TextConfig
from engine.layers.linear import LinearSlot, WeightAndBias
from engine.layers.rope import rotate_half

SCORE_BUDGET = 1 << 25  # elements of the [queries, heads, keys] score block computed at once


def top_keys(index: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores per row; exact ties (ReLU makes many scores exactly 0) go to the
    earliest positions, so the choice does not depend on the row's length or on how queries are batched."""
    thr = torch.topk(index, k, dim=-1).values[..., -1:]
    above = index > thr
    tied = index == thr
    need = k - above.sum(-1, keepdim=True)
    chosen = above | (tied & (tied.cumsum(-1) <= need))
    return torch.topk(chosen.to(torch.int8), k, dim=-1).indices


class Indexer(nn.Module):
    """Stored as `wq_b`, `wk`, `k_norm` (a LayerNorm: weight + bias) and `weights_proj`."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.n_heads, self.head_dim, self.rope_dim = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
        self.topk = cfg.index_topk
        self.wq_b = LinearSlot()
        self.wk = LinearSlot()
        self.k_norm = WeightAndBias()
        self.weights_proj = LinearSlot()
        self.scale = self.head_dim ** -0.5

    def _rope(self, x, cos, sin):
        r = self.rope_dim
        return torch.cat([rotate_half(x[..., :r], cos, sin), x[..., r:]], dim=-1)

    def select(self, x: torch.Tensor, q_lat: torch.Tensor, cache, step, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B,S,H], q_lat [B,S,q_lora]; writes this step's keys into the cache (LayerKV) and scores
        every earlier key of each sequence (the keys stay on the device; the latent may not).
        Returns (positions [B,S,k], valid [B,S,k]) with k = min(topk, longest sequence so far)."""
        B, S, _ = x.shape
        dt = x.dtype
        q = self.wq_b(q_lat).view(B, S, self.n_heads, self.head_dim)
        q = self._rope(q, cos[:, :, None], sin[:, :, None])
        k = F.layer_norm(self.wk(x), (self.head_dim,), self.k_norm.weight.to(dt), self.k_norm.bias.to(dt), 1e-6)
        cache.write_index(step, self._rope(k, cos, sin))
        keys = cache.read_index(step.rows, torch.float32)  # [B,T,D]
        T = keys.shape[1]
        w = self.weights_proj(x).float() * self.n_heads ** -0.5  # [B,S,h]
        k_sel = min(self.topk, T)
        pos = step.positions  # [B,S]
        chunk = max(1, SCORE_BUDGET // max(1, B * self.n_heads * T))
        idx_parts = []
        for s0 in range(0, S, chunk):
            s1 = min(S, s0 + chunk)
            scores = torch.einsum("bshd,btd->bsht", q[:, s0:s1].float(), keys).mul_(self.scale).relu_()
            index = torch.einsum("bsh,bsht->bst", w[:, s0:s1], scores)
            future = torch.arange(T, device=x.device)[None, None, :] > pos[:, s0:s1, None]
            index = index.masked_fill(future, float("-inf"))
            idx_parts.append(top_keys(index, k_sel))
        idx = torch.cat(idx_parts, dim=1)
        valid = idx <= pos[:, :, None]
        return idx, valid
