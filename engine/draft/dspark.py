"""DeepSeek-V4.1's DSpark block drafter (draft kind "dspark"): its stages `mtp.{M}.*` and the drafter that runs them.

What it is (FACTS.md "DeepSeek-V4.1 and draft heads"; the same algorithm as mlx-vlm 0.7.10's deepseek_v4_dspark
drafter for V4's layout, the only implementation on this machine): the target's residual after the layers of
`dspark_target_layer_ids`, each averaged over its hc streams and concatenated, goes through the first stage's
`main_proj` and `main_norm`: the context. Each stage is a window-only V4.1 block whose attention reads that context's
keys (its own `wkv` / `kv_norm`, RoPE at the context's positions, kept for the last `sliding_window` - 1 positions
plus those read since the last block) and the block's own: a block is the anchor (the last verified token) and
`dspark_block_size` - 1 noise tokens (`dspark_noise_token_id`), at the positions after the context, attending to
all of it and to each other (no causal mask), with a sink per head. The last stage's streams collapse with its
pending weights (V4.1 has no hc_head), its `norm`, the target's head: the block's base logits. Draft j is the
argmax of base logits j plus the Markov bias of draft j-1 (the anchor for j = 0): `markov_head.head` of
`markov_head.embed`[previous token]. The confidence head (sigmoid of `proj` over the hidden state and that
embedding) is loaded; greedy drafting proposes the whole block and the target decides, so it is not consulted.

DeepSeek-V4's DSpark layout (V4-Flash-0731: V4 blocks, `hc_head` and `markov_w1` / `markov_w2` on the last stage) is
the same drafter over V4 stages (engine/draft/dspark_v4.py).

The drafter reads the target's context where engine/runtime/speculative.py hands the MTP drafter its residual:
`Model.tap_layers` makes the forward collect the taps instead, each stage passing those of its layers on with the
residual, so the last stage (the drafter's) has them all."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import TextConfig
from engine.draft.context import Context
from engine.layers.linear import LinearSlot, resolve_linears
from engine.layers.slots import Stored, load_unit, slot
from engine.models.deepseek_v4.attention import attend_with_sink, grouped_output
from engine.models.deepseek_v4.norm import V4RMSNorm
from engine.models.deepseek_v4.rope import rope_tail
from engine.models.deepseek_v41.attention import V41Attention
from engine.models.deepseek_v41.block import collapse, through
from engine.models.deepseek_v41.config import v41_config
from engine.models.deepseek_v41.moe import V41MoE
from kconvert.distributed import Group
from kconvert.errors import CheckpointError, EngineError, UsageError


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


class DSparkDrafter:
    """engine/draft/drafter.Drafter's calls (start, extend, score, resume, draft) for a DSpark drafter."""

    def __init__(self, model, k: int | None = None):
        sec = model.cfg.section
        self.model, self.ctx = model, Context(model)
        self.stages = [model.draft_heads[str(L)] for L in sorted(model.draft_layers)]
        if not (self.stages[0].first and self.stages[-1].last):
            raise CheckpointError(f"the DSpark drafter's stages {sorted(model.draft_layers)} are not all of "
                                  f"num_nextn_predict_layers", file="config.json")
        self.block = int(sec.get("dspark_block_size") or 0)
        self.noise = int(sec.get("dspark_noise_token_id", -1))
        if self.block < 1 or not 0 <= self.noise < model.cfg.vocab_size:
            raise CheckpointError("a DSpark drafter needs dspark_block_size >= 1 and a dspark_noise_token_id in the "
                                  "vocabulary", file="config.json")
        self.k = self.block if k is None else k
        if not 1 <= self.k <= self.block:
            raise UsageError(f"a DSpark drafter proposes 1..{self.block} tokens a round (one block), not {self.k}")
        self.window = self.stages[0].window
        self.keys: list[torch.Tensor] = []
        self.length, self.seen, self.anchor, self.tail = 0, 0, None, None

    @staticmethod
    def tap_layers(model) -> list[int]:
        """The target layers whose residual the drafter reads (their taps travel with the residual to the last
        pipeline stage: engine/pipeline.py)."""
        taps = [int(L) for L in model.cfg.section.get("dspark_target_layer_ids") or []]
        if not taps:  # (each names a decoder layer: the manifest's limits checked that when the config was bound)
            raise CheckpointError("dspark_target_layer_ids is empty: the DSpark drafter reads no target layer",
                                  file="config.json")
        return taps

    def start(self, max_len: int) -> None:
        self.keys = [None] * len(self.stages)
        self.length, self.seen, self.anchor, self.tail = 0, 0, None, None

    @torch.inference_mode()
    def extend(self, x: torch.Tensor, tokens: list[int]) -> None:
        """Read positions length..length+S-1: x [1,S,len(targets) * hidden] the taps there, tokens the S tokens
        after them (the last one is the next block's anchor)."""
        ctx = self.stages[0].context(x.to(self.model.device))
        for i, stage in enumerate(self.stages):
            new = stage.context_keys(ctx, self.length)
            self.keys[i] = new if self.keys[i] is None else torch.cat([self.keys[i], new], 1)
        self.length += x.shape[1]
        self.anchor, self.tail = int(tokens[-1]), x[:, -1:]

    def _blocks(self, anchors: torch.Tensor, keys: list, starts: torch.Tensor, visible=None) -> torch.Tensor:
        """Base logits [B, block, vocab] of B blocks (anchors [B], row b's at positions starts[b]..)."""
        m, last = self.model, self.stages[-1]
        ids = torch.cat([anchors[:, None], torch.full((len(anchors), self.block - 1), self.noise)], 1)
        h = m.stack.enter(self.ctx.embed(ids.to(m.device), None))
        for stage, k in zip(self.stages, keys):
            h = stage(h, k, starts.to(m.device), m.par, visible)
        return self.ctx.logits(last.leave(h), None)

    def _base_logits(self) -> torch.Tensor:
        """The next block's base logits [block, vocab] after the positions read; the keys read since the last block
        are seen from now on (the context keeps window - 1 of them, plus those read next)."""
        keep = max(0, self.seen - (self.window - 1))
        self.keys = [k[:, keep:] for k in self.keys]
        self.seen = self.keys[0].shape[1]
        return self._blocks(torch.tensor([self.anchor]), self.keys, torch.tensor([self.length]))[0]

    @torch.inference_mode()
    def draft(self, k: int) -> list[int]:
        """k (<= dspark_block_size) greedy drafts after the last position read: one block."""
        if k <= 0:
            return []
        if k > self.block:
            raise EngineError(f"a DSpark block holds {self.block} drafts, {k} were asked")
        base, last = self._base_logits(), self.stages[-1]
        prev, drafts = self.anchor, []
        for j in range(k):
            prev = int((base[j] + last.markov(torch.tensor([prev], device=base.device))[0]).argmax())
            drafts.append(prev)
        return drafts

    @torch.inference_mode()
    def score(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [S, V] the first draft is taken from at every position of a sequence read from its start: at
        position i the context is x[:, :i+1] (as decoding reads it one position a block: the last `window`
        positions seen) and the anchor tokens[0, i] (verify's next-token check: position i predicts token i + 2,
        as an MTP head's does). One batch of S blocks."""
        self.start(x.shape[1])
        S, dev = x.shape[1], self.model.device
        ctx = self.stages[0].context(x.to(dev))
        keys = [stage.context_keys(ctx, 0) for stage in self.stages]
        i, j = torch.arange(S, device=dev)[:, None], torch.arange(S, device=dev)[None]
        visible = (j <= i) & (j > i - self.window)
        anchors = tokens[0].to(dev)
        base = self._blocks(anchors, keys, torch.arange(1, S + 1), visible)[:, 0]
        return base + self.stages[-1].markov(anchors)

    def resume(self, n: int) -> torch.Tensor:
        """A new turn continues the target at its length n: forget the last position read and give back its taps."""
        if n != self.length or self.tail is None:
            raise EngineError(f"the drafter holds {self.length} positions; the target continues at {n}")
        tail = self.tail
        self.keys = [k[:, :-1] for k in self.keys]
        self.length, self.seen = n - 1, min(self.seen, self.keys[0].shape[1])
        self.anchor = self.tail = None
        return tail
