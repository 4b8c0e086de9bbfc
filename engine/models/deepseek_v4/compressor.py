"""DeepSeek-V4's compressed branches: the compressor (HCA: one entry per `rate` tokens; CSA: the same over
overlapping windows of 2 * rate tokens) and the CSA lightning indexer that picks each query's top-k entries.

An entry is a softmax-gated sum over its window (gate + `position_bias` per slot), RMS-normed, with RoPE
at the window's first token. CSA projects two series per token (width 2 * dim): entry w mixes window w - 1's
first series with window w's second, so the cache keeps the last full window's first series (`overlap`).
Entry w covers tokens up to (w + 1) * rate - 1: query t may use entries w < (t + 1) // rate."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.deepseek_v3.dsa_indexer import top_keys
from engine.layers.linear import LinearSlot
from engine.layers.slots import slot
from engine.models.deepseek_v4.compressor_state import CompressorState
from engine.models.deepseek_v4.config import V4Config
from engine.models.deepseek_v4.entry_format import key_format
from engine.models.deepseek_v4.norm import V4RMSNorm
from engine.models.deepseek_v4.rope import V4Rotary, rope_tail


class Compressor(nn.Module):
    """`kv_proj`, `gate_proj` [width, hidden], `position_bias` [rate, width], `kv_norm` [dim];
    width = 2 * dim when `overlap` (CSA), else dim (HCA)."""

    def __init__(self, c: V4Config, dim: int, rate: int, overlap: bool, rotary: V4Rotary):
        super().__init__()
        self.dim, self.rate, self.overlap, self.rotary = dim, rate, overlap, rotary
        self.kv_proj, self.gate_proj = LinearSlot(), LinearSlot()
        slot(self, "position_bias")
        self.kv_norm = V4RMSNorm(c.eps)

    def forward(self, x: torch.Tensor, state: CompressorState, fmt, host: bool = False) -> None:
        """Append to `state` the entries completed by x [B, S, hidden] (the next tokens of its sequence);
        `fmt` encodes them (engine/models/deepseek_v4/entry_format.py); `host`: they live in host memory."""
        B, d, r = x.shape[0], self.dim, self.rate
        state.ready(fmt, B, r, 2 * d if self.overlap else d, d, self.overlap, x.device, host)
        kv, gate, first = state.take(self.kv_proj(x), self.gate_proj(x), r)
        n = kv.shape[1] // r
        if n == 0:
            return
        kv = kv.view(B, n, r, -1)
        gate = gate.view(B, n, r, -1) + self.position_bias
        if self.overlap:
            kv, gate = self._overlapping(kv, gate, state)
        weights = gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)
        new = self.kv_norm((kv * weights).sum(dim=2))
        cos, sin = self.rotary(first + r * torch.arange(n, device=x.device), new.dtype)
        state.append(rope_tail(new, cos, sin))

    def _overlapping(self, kv, gate, state: CompressorState):
        """[B, n, 2r, dim]: window w - 1's first series (from the cache for w = 0; none at the start:
        weight 0) then window w's second series."""
        B, n, r, _ = kv.shape
        d = self.dim
        if state.has_overlap:
            prev_kv, prev_gate = state.overlap_kv[:, None].to(kv.dtype), state.overlap_gate[:, None].to(gate.dtype)
        else:
            prev_kv = kv.new_zeros(B, 1, r, d)
            prev_gate = gate.new_full((B, 1, r, d), float("-inf"))
        first_kv = torch.cat([prev_kv, kv[:, :-1, :, :d]], dim=1)
        first_gate = torch.cat([prev_gate, gate[:, :-1, :, :d]], dim=1)
        state.keep_overlap(kv[:, :, :, :d], gate[:, :, :, :d])  # every window's: a rewind may need an earlier one
        return torch.cat([first_kv, kv[..., d:]], dim=2), torch.cat([first_gate, gate[..., d:]], dim=2)


def visible(positions: torch.Tensor, n: int, rate: int) -> torch.Tensor:
    """[B, S, n]: entry w is complete before query position t (w < (t + 1) // rate)."""
    return torch.arange(n, device=positions.device) < ((positions + 1) // rate)[..., None]


class Scorer(nn.Module):
    """`weights_proj` [index_heads, hidden]: each indexer head's weight per query."""

    def __init__(self):
        super().__init__()
        self.weights_proj = LinearSlot()


class Indexer(Compressor):
    """An overlapping compressor of its own at `index_head_dim` (`kv_proj`, `gate_proj`, `position_bias`,
    `kv_norm`: on the indexer itself, as transformers names them), `q_b_proj` (from the attention's q LoRA)
    and `scorer.weights_proj`. Scores entry s for query t as sum_h w[t,h] * ReLU(q[t,h] . k[s]) / sqrt(dim) and
    keeps the top `index_topk` complete entries.

    Tie rule: entries of exactly equal score (ReLU makes exact zeros common) are taken earliest first
    (engine.models.deepseek_v3.dsa_indexer.top_keys), so the choice does not depend on the sequence length or on chunking."""

    def __init__(self, c: V4Config, rate: int, rotary: V4Rotary):
        super().__init__(c, c.index_head_dim, rate, True, rotary)
        self.heads, self.topk = c.index_heads, c.index_topk
        self.q_b_proj = LinearSlot()
        self.scorer = Scorer()

    def choose(self, x: torch.Tensor, q_lora: torch.Tensor, positions: torch.Tensor, state: CompressorState,
               cos: torch.Tensor, sin: torch.Tensor, fmt=None) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(entries [B, S, k] each query attends to (its top-k among the complete ones), valid [B, S, k],
        entries so far n) after appending x's keys to `state` (encoded by `fmt`; default: the compute dtype).
        cos / sin: the attention's, at the same positions (the indexer shares its rotary)."""
        B, S, _ = x.shape
        self.forward(x, state, fmt or state.fmt or key_format(self.dim, None, x.dtype))
        n = state.count
        if n == 0:
            empty = torch.zeros(B, S, 0, dtype=torch.long, device=x.device)
            return empty, empty.bool(), 0
        keys = state.entries(torch.float32)  # [B, n, dim]: every key is scored
        q = self.q_b_proj(q_lora).view(B, S, self.heads, self.dim)
        q = rope_tail(q, cos[:, :, None], sin[:, :, None])
        scores = F.relu(torch.einsum("bshd,bnd->bshn", q.float(), keys)) * self.dim ** -0.5
        w = self.scorer.weights_proj(x).float() * self.heads ** -0.5
        index = torch.einsum("bshn,bsh->bsn", scores, w)
        ok = visible(positions, n, self.rate)
        chosen = top_keys(index.masked_fill(~ok, float("-inf")), min(self.topk, n))
        return chosen, ok.gather(-1, chosen), n

    def select(self, x: torch.Tensor, q_lora: torch.Tensor, positions: torch.Tensor, state: CompressorState,
               cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """[B, S, n] bool: `choose`'s entries as a mask over all of them."""
        chosen, valid, n = self.choose(x, q_lora, positions, state, cos, sin)
        mask = torch.zeros(*chosen.shape[:2], n, dtype=torch.bool, device=x.device)
        return mask.scatter_(-1, chosen, valid)
