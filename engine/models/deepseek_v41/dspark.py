"""DeepSeek-V4.1's DSpark stage (draft kind "dspark"): `mtp.{M}.*` as stored, run by the DSpark block drafter
(engine/draft/dspark.py). Each stage is a window-only V4.1 block whose attention reads the drafter's context keys
(its own `wkv` / `kv_norm`, RoPE at the context's positions) and the block's own tokens; the last stage's streams
collapse with its pending weights (V4.1 has no hc_head), its `norm`; the Markov bias is `markov_head.head` of
`markov_head.embed`[previous token]. The stages route over their own expert bank where the config gives one
(the manifest's `expert_bank`: V4.1-Flash's 128 experts, 3 a token)."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import TextConfig
from engine.layers.linear import LinearSlot, resolve_linears
from engine.layers.slots import Stored, load_unit, slot
from engine.models.deepseek_v4.attention import attend_block, grouped_output
from engine.models.deepseek_v4.norm import V4RMSNorm
from engine.models.deepseek_v4.rope import rope_tail
from engine.models.deepseek_v41.attention import V41Attention
from engine.models.deepseek_v41.block import collapse, through
from engine.models.deepseek_v41.config import v41_config
from engine.models.deepseek_v41.moe import V41MoE
from kconvert.distributed import Group


class V41DsparkStage(nn.Module):
    """One stage, `mtp.{M}.*` as stored: a V4.1 block's tensors (window-only attention, MoE, the two hc mixings),
    `main_proj` / `main_norm` on the first stage, `norm`, `markov_head.{embed,head}` and `confidence_head.proj` on
    the last. What the drafter calls of a stage: first / last / window, context (first), context_keys, forward,
    leave and markov (last)."""

    own_components = None  # every tensor of the stage sits under mtp.{M}. (engine/draft/registry.own_prefix)
    staged = True  # told its first / last by the manifest's layer kinds (engine/draft/registry.draft_head)

    def __init__(self, cfg: TextConfig, layer: int, par: Group, *, first: bool, last: bool,
                 bank: tuple[int, int] | None = None):
        super().__init__()
        base = v41_config(cfg)
        experts, top_k = bank or (base.experts, base.top_k)  # its own routed experts (V4.1-Flash: 128, 3 a token)
        # a stage: window only, over its own expert bank
        c = self.c = replace(base, ratios=base.ratios + (0,) * (layer + 1 - len(base.ratios)), experts=experts,
                             top_k=top_k)
        self.layer, self.first, self.last, self.window = layer, first, last, c.window
        self.attn_norm, self.ffn_norm = V4RMSNorm(c.eps), V4RMSNorm(c.eps)
        self.attn = V41Attention(c, layer, par)
        self.ffn = V41MoE(c, par)
        for name in ("hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale"):
            slot(self, name)
        if self.first:
            self.main_proj, self.main_norm = LinearSlot(), V4RMSNorm(c.eps)
        if self.last:
            self.norm = V4RMSNorm(c.eps)
            self.markov_head = nn.Module()
            self.markov_head.embed, self.markov_head.head = Stored(), Stored()
            self.confidence_head = nn.Module()
            self.confidence_head.proj = nn.Module()
            slot(self.confidence_head.proj, "weight")
            slot(self.confidence_head.proj, "bias", optional=True)  # vLLM's V4.1 DSpark builds it without one

    def load(self, unit: str, tensors: dict, block_prefix: str, own_prefix: str, linear_format) -> None:
        resolve_linears(self, own_prefix, linear_format)
        load_unit(unit, {own_prefix: self}, tensors)

    def own(self, component: str):
        return None  # the stages share the target's embeddings and head

    def context(self, taps: torch.Tensor) -> torch.Tensor:
        """First stage: the context [B,S,hidden] from the taps [B,S,len(targets) * hidden]."""
        return self.main_norm(self.main_proj(taps))

    def context_keys(self, ctx: torch.Tensor, start: int) -> torch.Tensor:
        """This stage's keys [B,S,head_dim] of the context at positions start.., RoPE applied."""
        a = self.attn
        B, S, _ = ctx.shape
        cos, sin = a.rotary((start + torch.arange(S, device=ctx.device))[None].expand(B, S), ctx.dtype)
        return rope_tail(a.kv_norm(a.wkv(ctx)), cos, sin)

    def _attend(self, h: torch.Tensor, keys: torch.Tensor, starts: torch.Tensor, visible) -> torch.Tensor:
        """Each row's block (its anchor at position starts[b]) attends to the context's keys [1 or B,T,head_dim]
        (`visible` [B,T]: those row b sees; None: all) and to its own tokens, no causal mask; this rank's heads'
        partial output."""
        a, c = self.attn, self.c
        B, L, _ = h.shape
        cos, sin = a.rotary(starts[:, None] + torch.arange(L, device=h.device), h.dtype)
        q = rope_tail(a.wq_b(a.q_norm(a.wq_a(h))).view(B, L, a.heads, c.head_dim), cos[:, :, None], sin[:, :, None])
        own = rope_tail(a.kv_norm(a.wkv(h)), cos, sin)
        o = attend_block(q, own, keys, visible, a.attn_sink, a.scale)
        return grouped_output(o, cos, sin, a.groups, a.wo_a, a.wo_b)

    def forward(self, x: torch.Tensor, keys: torch.Tensor, starts: torch.Tensor, par: Group,
                visible: torch.Tensor | None = None) -> torch.Tensor:
        """The residual [B,L,hc,hidden + 1] of B blocks (row b's at positions starts[b]..) through this stage."""
        H = self.c.hidden
        return through(self, x[..., :H], x[..., H].float(), lambda h: self._attend(h, keys, starts, visible), None,
                       par)

    def leave(self, x: torch.Tensor) -> torch.Tensor:
        """Last stage: the block's residual collapsed (its pending weights: V4.1 has no hc_head) and normed."""
        H = self.c.hidden
        return self.norm(collapse(x[..., :H], x[..., H].float()))

    def markov(self, prev: torch.Tensor) -> torch.Tensor:
        """Last stage: the Markov bias [N, vocab] after the tokens prev [N]."""
        m = self.markov_head
        return F.linear(m.embed.weight[prev].float(), m.head.weight.float())
