"""DeepSeek-V4.1 attention (stored as `layers.N.attn.*`): V4's shared-KV multi-query attention over a sliding window
plus, on a compressed layer (`compress_ratios[L]` > 0), the entries an indexer chose, with a learned sink per head
and a grouped output. What differs from V4 (engine/models/deepseek_v4/attention.py): queries get no per-head norm,
and compression is by role (engine/models/deepseek_v41/config.py): a KV source's compressor makes entries that
later layers read, an indexer's choice is reused by the compressed layers after it that have none.

Queries: `wq_a` -> `q_norm` -> `wq_b` (per head) with RoPE on the trailing rope dims; one K=V head `wkv` -> `kv_norm`
-> RoPE; the output's rope dims are rotated back, heads go in `o_groups` groups through `wo_a` (block-diagonal) and
`wo_b`. Window-only layers use the main rope, compressed ones the compress rope (YaRN, attention factor 1).

Tensor parallel: heads (`wq_b` rows, `attn_sink`) and whole output groups (`wo_a` rows, `wo_b` columns) per rank;
everything else, compressors and indexers included, replicated. The output is this rank's partial sum."""

from __future__ import annotations

import torch
from torch import nn

from engine.models.deepseek_v41.cache import V41LayerView
from engine.layers.linear import LinearSlot
from engine.layers.slots import slot
from engine.models.deepseek_v4.norm import V4RMSNorm
from engine.models.deepseek_v4.attention import attend_with_sink, grouped_output
from engine.models.deepseek_v4.rope import V4Rotary, rope_tail
from engine.models.deepseek_v41.compressor import V41Compressor, V41Indexer
from engine.models.deepseek_v41.config import V41Config
from kconvert.distributed import Group
from kconvert.errors import EngineError


class V41Attention(nn.Module):
    def __init__(self, c: V41Config, layer: int, par: Group):
        super().__init__()
        if c.heads % c.o_groups or c.o_groups % par.tp:
            raise EngineError(f"{c.heads} heads in {c.o_groups} output groups do not split over tp={par.tp}")
        self.c, self.layer = c, layer
        self.heads, self.groups = c.heads // par.tp, c.o_groups // par.tp
        self.ratio = c.ratios[layer]
        self.rotary = V4Rotary(c.compress_rope if self.ratio else c.main_rope, c.rope_dim)
        self.wq_a, self.q_norm, self.wq_b = LinearSlot(), V4RMSNorm(c.eps), LinearSlot()
        self.wkv, self.kv_norm = LinearSlot(), V4RMSNorm(c.eps)
        self.wo_a, self.wo_b = LinearSlot(), LinearSlot()
        slot(self, "attn_sink")
        if self.ratio and layer in c.kv_sources:
            self.compressor = V41Compressor(c, self.ratio, self.rotary)
        if self.ratio and layer in c.indexers:
            self.indexer = V41Indexer(c, layer, self.rotary)
        self.scale = c.head_dim ** -0.5

    def forward(self, x: torch.Tensor, start: int, view: V41LayerView) -> torch.Tensor:
        c, st, hand = self.c, view.state.at(start), view.handoff
        B, S, _ = x.shape
        pos = (start + torch.arange(S, device=x.device))[None].expand(B, S)
        cos, sin = self.rotary(pos, x.dtype)
        q_lora = self.q_norm(self.wq_a(x))
        q = rope_tail(self.wq_b(q_lora).view(B, S, self.heads, c.head_dim), cos[:, :, None], sin[:, :, None])
        fmt = st.entry_format(c.head_dim, c.rope_dim, x.dtype)
        kv = rope_tail(self.kv_norm(self.wkv(x)), cos, sin)
        rows = fmt.encode(kv)
        kv = kv if fmt.exact else fmt.decode(rows, x.dtype)  # as the cache gives it back: chunking changes nothing
        ring = st.window(B, c.window - 1, fmt, x.device)
        past = fmt.decode(ring.read(start), x.dtype)
        keys = torch.cat([past, kv], 1) if past.shape[1] else kv
        ring.write(rows, start + S)
        T = keys.shape[1]
        key_pos = start + S - T + torch.arange(T, device=x.device)
        near = (key_pos <= pos[..., None]) & (key_pos > pos[..., None] - c.window)
        logits = [torch.einsum("bshd,btd->bhst", q, keys).masked_fill(~near[:, None], float("-inf"))]
        values = [keys]
        if self.ratio:
            chosen, valid = self._choice(x, q_lora, pos, cos, sin, st, hand, fmt)
            if chosen is not None and chosen.shape[-1]:
                entries = hand.state(c.entries_from[self.layer]).entries
                picked = entries.gather(chosen, q.dtype)  # [B, S, k, D]
                logits.append(torch.einsum("bshd,bskd->bhsk", q, picked).masked_fill(~valid[:, None], float("-inf")))
                values.append(picked)
        st.length += S
        return self._output(self._attend(logits, values), cos, sin)

    def _choice(self, x, q_lora, pos, cos, sin, st, hand, fmt):
        """The entries each query attends to (None: the window alone): this layer's compressor and indexer run first
        where it has them."""
        c, L = self.c, self.layer
        if hasattr(self, "compressor"):
            latent, first = self.compressor(x, st.entries, fmt, host=st.host_entries)
            if hasattr(self, "indexer") and self.indexer.owns_keys:
                self.indexer.publish(x, latent, first, st.keys, st.key_format(c.index_head_dim, x.dtype))
        if not c.attends(L):  # nothing to read yet (no indexer, or one without keys): the window alone
            return None, None
        if hasattr(self, "indexer"):
            chosen, valid, picked = self.indexer.choose(x, q_lora, pos, hand.state(c.keys_from[L]).keys, cos, sin,
                                                        hand.candidates)
            hand.chosen[L] = (chosen, valid)
            if picked is not None:
                hand.candidates = picked
            return chosen, valid
        if c.choice_from[L] not in hand.chosen:
            raise EngineError(f"DeepSeek-V4.1 layer {L} reuses indexer {c.choice_from[L]}'s choice, which this forward "
                              "did not make")
        return hand.chosen[c.choice_from[L]]

    def _attend(self, logits: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
        return attend_with_sink(logits, values, self.attn_sink, self.scale)  # [window keys | chosen entries | sink]

    def _output(self, o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return grouped_output(o, cos, sin, self.groups, self.wo_a, self.wo_b)
