"""DeepSeek-V4 attention (kind "v4"): shared-KV multi-query attention over a sliding window plus, on CSA and
HCA layers, compressed entries (engine/models/deepseek_v4/compressor.py), with a learned sink per head and a grouped output.

Queries: `q_a_proj` -> `q_a_norm` -> `q_b_proj`, then a weightless RMS norm per head. One K=V head: `kv_proj`
-> `kv_norm`. RoPE rotates the trailing rope dims of both (main rope on sliding layers, the compress rope
on CSA / HCA ones); since values carry it too, the output's rope dims are rotated back at the query's
position. `sinks` [heads] is one more softmax column that takes probability and gives nothing. Output:
heads in `o_groups` groups, `o_a_proj` maps each group on its own (block-diagonal), `o_b_proj` mixes them.

Tensor parallel: heads (`q_b_proj` rows, `sinks`) and whole groups (`o_a_proj` rows, `o_b_proj` columns) per
rank; `q_a_proj`, `kv_proj` and the compressors are replicated. The output is this rank's partial sum."""

from __future__ import annotations

import torch
from torch import nn

from engine.config import TextConfig
from engine.layers.linear import LinearSlot
from engine.layers.slots import slot
from engine.models.deepseek_v4.cache import V4LayerState
from engine.models.deepseek_v4.compressor import Compressor, Indexer, visible
from engine.models.deepseek_v4.config import CSA, SLIDING, v4_config
from engine.models.deepseek_v4.norm import V4RMSNorm, unweighted_rms_norm
from engine.models.deepseek_v4.rope import V4Rotary, rope_tail
from kconvert.distributed import Group
from kconvert.errors import EngineError


class V4Attention(nn.Module):
    def __init__(self, cfg: TextConfig, layer: int, par: Group):
        super().__init__()
        c = self.c = v4_config(cfg)
        if c.heads % c.o_groups or c.o_groups % par.tp:
            raise EngineError(f"{c.heads} heads in {c.o_groups} output groups do not split over tp={par.tp}")
        self.heads, self.groups = c.heads // par.tp, c.o_groups // par.tp
        self.kind, self.rate = c.layer_kinds[layer], c.rate(layer)
        self.rotary = V4Rotary(c.main_rope if self.kind == SLIDING else c.compress_rope, c.rope_dim)
        self.q_a_proj = LinearSlot()
        self.q_a_norm = V4RMSNorm(c.eps)
        self.q_b_proj = LinearSlot()
        self.kv_proj = LinearSlot()
        self.kv_norm = V4RMSNorm(c.eps)
        self.o_a_proj = LinearSlot()
        self.o_b_proj = LinearSlot()
        slot(self, "sinks")
        self.compressor = None
        if self.kind != SLIDING:
            self.compressor = Compressor(c, c.head_dim, self.rate, self.kind == CSA, self.rotary)
            if self.kind == CSA:
                self.compressor.indexer = Indexer(c, self.rate, self.rotary)
        self.scale = c.head_dim ** -0.5

    def forward(self, x: torch.Tensor, start: int, cache: V4LayerState, cos=None, sin=None) -> torch.Tensor:
        """x [B,S,hidden] at positions start..start+S-1 (the model's cos/sin are not used: each layer
        kind has its own rope); returns this rank's partial output. A long prefill runs in blocks of queries
        whose score tensors stay within `block_elements` (the cache carries the state from block to block, as
        from one decode step to the next), so its transient memory does not grow with the prompt squared."""
        B, S, _ = x.shape
        blk = self._block(cache.at(start).length, B, S)
        if blk >= S:
            return self._forward(x, start, cache)
        return torch.cat([self._forward(x[:, a:a + blk], start + a, cache) for a in range(0, S, blk)], 1)

    block_elements = 1 << 27  # float32 elements of the largest score tensor a block may make (512 MiB)

    def _block(self, length: int, B: int, S: int) -> int:
        """Queries per block: the window's [heads, blk, blk + window] and the entries' / indexer's scores fit."""
        c, blk = self.c, S
        n = (length + S) // self.rate if self.rate else 0
        while blk > 1 and B * blk * max(self.heads * (blk + c.window + n), c.index_heads * n) > self.block_elements:
            blk = (blk + 1) // 2
        return blk

    def _forward(self, x: torch.Tensor, start: int, cache: V4LayerState) -> torch.Tensor:
        c, st = self.c, cache.at(start)
        B, S, _ = x.shape
        pos = (start + torch.arange(S, device=x.device))[None].expand(B, S)
        cos, sin = self.rotary(pos, x.dtype)
        q_lora = self.q_a_norm(self.q_a_proj(x))
        q = unweighted_rms_norm(self.q_b_proj(q_lora).view(B, S, self.heads, c.head_dim), c.eps)
        q = rope_tail(q, cos[:, :, None], sin[:, :, None])
        fmt = st.entry_format(c.head_dim, c.rope_dim, x.dtype)
        kv = rope_tail(self.kv_norm(self.kv_proj(x)), cos, sin)  # [B,S,D]: the one key and value head
        rows = fmt.encode(kv)
        kv = kv if fmt.exact else fmt.decode(rows, x.dtype)  # as the cache gives it back: chunking changes nothing
        ring = st.window(B, c.window - 1, fmt, x.device)
        past = fmt.decode(ring.read(start), x.dtype)
        keys = torch.cat([past, kv], 1) if past.shape[1] else kv
        ring.write(rows, start + S)
        T = keys.shape[1]
        key_pos = start + S - T + torch.arange(T, device=x.device)
        near = (key_pos <= pos[..., None]) & (key_pos > pos[..., None] - c.window)  # [B,S,T]
        logits = [torch.einsum("bshd,btd->bhst", q, keys).masked_fill(~near[:, None], float("-inf"))]
        values = [keys]
        if self.compressor is not None:
            self.compressor(x, st.compressor, fmt, host=st.host_entries and self.kind == CSA)
            if self.kind == CSA:
                key_fmt = st.key_format(c.index_head_dim, x.dtype)
                chosen, valid, n = self.compressor.indexer.choose(x, q_lora, pos, st.indexer, cos, sin, key_fmt)
                logits_c, values_c = self._selected(q, st, chosen, valid, n)
            else:
                entries = st.compressor.entries(x.dtype)  # [B,n,D]
                seen = visible(pos, entries.shape[1], self.rate)
                logits_c = torch.einsum("bshd,bnd->bhsn", q, entries).masked_fill(~seen[:, None], float("-inf"))
                values_c = entries
            logits.append(logits_c)
            values.append(values_c)
        st.length += S
        return self._output(self._attend(logits, values), cos, sin)

    def _selected(self, q: torch.Tensor, st: V4LayerState, chosen: torch.Tensor, valid: torch.Tensor, n: int):
        """CSA: (logits, values) over the entries the indexer chose. Decode reads only those rows ([B,S,k,D] per
        query); a prefill chunk whose queries choose more rows than there are reads them all once, masked."""
        S, k = chosen.shape[1:]
        if S * k < n:
            picked = st.compressor.gather(chosen, q.dtype)  # [B,S,k,D]
            return torch.einsum("bshd,bskd->bhsk", q, picked).masked_fill(~valid[:, None], float("-inf")), picked
        entries = st.compressor.entries(q.dtype)
        seen = torch.zeros(*chosen.shape[:2], n, dtype=torch.bool, device=q.device).scatter_(-1, chosen, valid)
        return torch.einsum("bshd,bnd->bhsn", q, entries).masked_fill(~seen[:, None], float("-inf")), entries

    def _attend(self, logits: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
        return attend_with_sink(logits, values, self.sinks, self.scale)

    def _output(self, o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return grouped_output(o, cos, sin, self.groups, self.o_a_proj, self.o_b_proj)


def attend_with_sink(logits: list[torch.Tensor], values: list[torch.Tensor], sinks: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Softmax over [window keys | compressed entries | sink] per head -> [B,S,h,D] (in float32: the sink and the
    scores meet in one row, as wide as the window plus the entries). A value tensor is shared by the queries [B,T,D]
    or per query [B,S,k,D]. DeepSeek-V4's attention and V4.1's (its entries chosen by role) alike."""
    B, h, S, _ = logits[0].shape
    sink = sinks.float().view(1, h, 1, 1).expand(B, h, S, 1)
    p = torch.softmax(torch.cat([t.float() * scale for t in logits] + [sink], dim=-1), dim=-1)
    out, at = 0, 0
    for t, v in zip(logits, values):
        w = p[..., at:at + t.shape[-1]].to(v.dtype)
        out = out + torch.einsum("bhst,btd->bshd" if v.dim() == 3 else "bhst,bstd->bshd", w, v)
        at += t.shape[-1]
    return out


def grouped_output(o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups: int, wo_a, wo_b) -> torch.Tensor:
    """The heads' outputs back to the hidden size: the values' rotation undone at the query position, then wo_a
    block-diagonal over `groups` output groups ([g, o_lora_rank, in/g]) and wo_b."""
    B, S = o.shape[:2]
    o = rope_tail(o, cos[:, :, None], -sin[:, :, None])
    grouped = o.reshape(B, S, groups, -1)
    w = wo_a.dense(o.dtype).view(groups, -1, grouped.shape[-1])
    return wo_b(torch.einsum("bsgi,gri->bsgr", grouped, w).flatten(2))


def attend_block(q: torch.Tensor, own: torch.Tensor, keys: torch.Tensor, visible, sinks: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """Queries q [B,L,h,D] of a block over the context's keys [1 or B,T,D] (`visible` [B,T] or None: all) and the
    block's own K=V rows own [B,L,D], no causal mask, a sink per head -> [B,L,h,D]."""
    B = q.shape[0]
    ctx = keys.to(q.dtype).expand(B, -1, -1)
    seen = torch.einsum("bshd,btd->bhst", q, ctx)
    if visible is not None:
        seen = seen.masked_fill(~visible[:, None, None, :], float("-inf"))
    return attend_with_sink([seen, torch.einsum("bshd,btd->bhst", q, own)], [ctx, own], sinks, scale)
