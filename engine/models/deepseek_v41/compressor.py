"""DeepSeek-V4.1's compressed branch: a KV source's compressor and an indexer (stored as `attn.compressor.*` and
`attn.indexer.*`).

Compressor (`wkv`, `wgate` when the ratio is above 1, `norm`): every `ratio` tokens make one entry, the gated
(softmax over the group, per channel) sum of their projections, RMS-normed; ratio 1 is the normed projection of
each token. No overlap and no position bias (V4's CSA has both). The entry is stored with RoPE at its group's first
token; the unrotated entry is what an index-key owner projects (`indexer.wk`, `indexer.k_norm`) into its keys.

Indexer (`wq_b` from the attention's q LoRA, `weights_proj`): scores entry s for query t as
sum_h w[t, h] ReLU(q[t, h] . k[s]) / sqrt(dim) over the visible entries (s < (t + 1) // ratio) and keeps the
`index_topk` best (ties: earliest first, as the reference's stable sort); on layers after the candidate source,
only entries inside that layer's chosen blocks score. The candidate source itself picks, per query, the
`candidate_topk_blocks` blocks of `candidate_block_size` entries whose best score is highest, always keeping the
block of the newest visible entry."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.linear import LinearSlot
from engine.models.deepseek_v3.dsa_indexer import top_keys
from engine.models.deepseek_v4.norm import V4RMSNorm
from engine.models.deepseek_v4.rope import V4Rotary, rope_tail
from engine.models.deepseek_v4.compressor_state import CompressorState
from engine.models.deepseek_v41.config import V41Config


def _ready(state: CompressorState, fmt, B: int, rate: int, width: int, device, host: bool = False) -> None:
    if state.store is None:
        state.ready(fmt, B, max(rate, 1), width, width, False, device, host)


class V41Compressor(nn.Module):
    def __init__(self, c: V41Config, ratio: int, rotary: V4Rotary):
        super().__init__()
        self.ratio, self.dim, self.rotary = ratio, c.head_dim, rotary
        self.wkv = LinearSlot()
        if ratio > 1:
            self.wgate = LinearSlot()
        self.norm = V4RMSNorm(c.eps)

    def forward(self, x: torch.Tensor, state: CompressorState, fmt, host: bool = False):
        """Append to `state` the entries x [B, S, hidden] completes; returns (the new entries unrotated [B, n, dim]
        or None, the first one's entry number)."""
        B, r = x.shape[0], self.ratio
        _ready(state, fmt, B, r, self.dim, x.device, host)
        first = state.count
        if r == 1:
            latent = self.norm(self.wkv(x))
        else:
            xf = x.float()  # the reference pools in float32
            kv, gate, _ = state.take(self.wkv(xf), self.wgate(xf), r)
            n = kv.shape[1] // r
            if n == 0:
                return None, first
            kv, gate = kv.view(B, n, r, -1), gate.view(B, n, r, -1)
            latent = self.norm((kv * gate.softmax(dim=2)).sum(dim=2).to(x.dtype))
        n = latent.shape[1]
        cos, sin = self.rotary(r * (first + torch.arange(n, device=x.device)), latent.dtype)
        state.append(rope_tail(latent, cos, sin))
        return latent, first


class V41Indexer(nn.Module):
    """`wq_b`, `weights_proj`; on an index-key owner also `wk`, `k_norm`."""

    def __init__(self, c: V41Config, layer: int, rotary: V4Rotary):
        super().__init__()
        self.c, self.layer, self.rotary = c, layer, rotary
        self.heads, self.dim, self.ratio = c.index_heads, c.index_head_dim, c.ratios[layer]
        self.owns_keys = c.keys_from[layer] == layer
        self.wq_b = LinearSlot()
        self.weights_proj = LinearSlot()
        if self.owns_keys:
            self.wk = LinearSlot()
            self.k_norm = V4RMSNorm(c.eps)

    def publish(self, x: torch.Tensor, latent: torch.Tensor | None, first: int, state: CompressorState, fmt) -> None:
        """An owner's keys of the entries its compressor just made from x (entry numbers first..)."""
        _ready(state, fmt, x.shape[0], 1, self.dim, x.device)
        if latent is None:
            return
        k = self.k_norm(self.wk(latent))
        cos, sin = self.rotary(self.ratio * (first + torch.arange(k.shape[1], device=k.device)), k.dtype)
        state.append(rope_tail(k, cos, sin))

    def choose(self, x: torch.Tensor, q_lora: torch.Tensor, positions: torch.Tensor, keys: CompressorState,
               cos: torch.Tensor, sin: torch.Tensor, candidates: torch.Tensor | None):
        """(entries [B, S, k], valid [B, S, k], the candidate blocks this layer picks or None)."""
        B, S, _ = x.shape
        end = int(positions[0, -1]) + 1
        n = keys.count if keys.store is not None else 0
        k = min(self.c.index_topk, end // self.ratio)
        if n == 0 or k == 0:
            empty = torch.zeros(B, S, 0, dtype=torch.long, device=x.device)
            return empty, empty.bool(), None
        kk = keys.entries(torch.float32)[:, :end // self.ratio]
        q = rope_tail(self.wq_b(q_lora).view(B, S, self.heads, self.dim), cos[:, :, None], sin[:, :, None])
        scores = F.relu(torch.einsum("bshd,bnd->bshn", q.float(), kk)) * self.dim ** -0.5
        w = self.weights_proj(x).float() * self.heads ** -0.5
        index = torch.einsum("bshn,bsh->bsn", scores, w)
        lens = ((positions + 1) // self.ratio)[..., None]  # [B, S, 1] entries each query sees
        index = index.masked_fill(torch.arange(index.shape[-1], device=x.device) >= lens, float("-inf"))
        picked = None
        if self.c.candidate_source == self.layer and self.c.candidate_blocks > 0:
            picked = self._blocks(index, lens)
        elif candidates is not None and self.c.uses_candidates(self.layer):
            index = index.masked_fill(~candidates[..., :index.shape[-1]], float("-inf"))
        chosen = top_keys(index, k)
        return chosen, chosen < lens, picked

    def _blocks(self, index: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """[B, S, n] bool: the entries of each query's best blocks (its newest visible entry's block pinned)."""
        bs, n = self.c.candidate_block_size, index.shape[-1]
        nb = -(-n // bs)
        best = F.pad(index, (0, nb * bs - n), value=float("-inf")).unflatten(-1, (nb, bs)).amax(-1)  # [B, S, nb]
        last = torch.where(lens > 0, (lens - 1) // bs, -1)
        pinned = best.masked_fill(torch.arange(nb, device=index.device) == last, float("inf"))
        keep = torch.zeros_like(best, dtype=torch.bool).scatter_(-1, top_keys(pinned, min(self.c.candidate_blocks, nb)), True)
        keep &= best > float("-inf")
        return keep.repeat_interleave(bs, dim=-1)[..., :n]
