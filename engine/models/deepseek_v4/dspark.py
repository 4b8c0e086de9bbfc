"""DeepSeek-V4's DSpark stage (draft kind "v4_dspark": V4-Flash-0731, V4-Flash / V4-Pro-DSpark): `mtp.{M}.*` as
released, a V4 block (window-only attention with the per-head query norm, top-k routed MoE, the two hyper-connections;
the engine keeps it under `model.layers.{num_hidden_layers + M}.`, as for V4's MTP block) plus its own tensors under
`mtp.{M}.`: `main_proj` / `main_norm` on the first stage, `hc_head_{fn,base,scale}`, `norm` and the Markov head
`markov_head.markov_w1` (an embedding [vocab, rank]) / `markov_w2` (rank -> vocab) and `confidence_head.proj` on the
last. The drafter (engine/draft/dspark.DSparkDrafter) is V4.1's; mlx-vlm 0.7.10's deepseek_v4_dspark drafter is its
reference (kconvert/verify/mlx_dspark.py). Which stage is first / last the manifest's `first_stage` / `last_stage`
layer kinds say, bound with the stages the conversion holds (the checkpoint's names count them: its config says
`num_nextn_predict_layers: 1` over three), as for V4.1's stages (engine/draft/registry.draft_head)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import TextConfig
from engine.models.deepseek_v4.attention import attend_block
from engine.models.deepseek_v4.mtp import hc_head_merge, mtp_block_config
from engine.layers.linear import LinearSlot, resolve_linears
from engine.layers.slots import Stored, load_unit, slot
from engine.models.deepseek_v4.config import v4_config
from engine.models.deepseek_v4.mhc import spread
from engine.models.deepseek_v4.norm import V4RMSNorm, unweighted_rms_norm
from engine.models.deepseek_v4.rope import rope_tail
from engine.models.registry import decoder_layer
from kconvert.distributed import Group


class V4DsparkStage(nn.Module):
    staged = True  # told its first / last by the manifest's layer kinds (engine/draft/registry.draft_head)

    def __init__(self, cfg: TextConfig, layer: int, par: Group, *, first: bool, last: bool,
                 bank: tuple[int, int] | None = None):  # bank: the manifest's; V4's stages route over the target's
        super().__init__()
        c = self.c = v4_config(cfg)
        self.layer, self.window, self.first, self.last = layer, c.window, first, last
        self.block = decoder_layer(mtp_block_config(cfg, layer), layer, par)
        own = self.own_tensors = nn.Module()  # mtp.{M}.*: attribute paths are the stored names under it
        if first:  # the context's projection and norm
            own.main_proj, own.main_norm = LinearSlot(), V4RMSNorm(c.eps)
        if last:  # the streams' merge, the final norm, the Markov and confidence heads
            own.norm = V4RMSNorm(c.eps)
            own.markov_head, own.confidence_head = nn.Module(), nn.Module()
            own.markov_head.markov_w1, own.markov_head.markov_w2 = Stored(), Stored()
            own.confidence_head.proj = nn.Module()
            for module, name in ((own, "hc_head_fn"), (own, "hc_head_base"), (own, "hc_head_scale"),
                                 (own.confidence_head.proj, "weight"), (own.confidence_head.proj, "bias")):
                slot(module, name)

    def load(self, unit: str, tensors: dict, block_prefix: str, own_prefix: str, linear_format) -> None:
        resolve_linears(self.block, block_prefix, linear_format)
        resolve_linears(self.own_tensors, own_prefix, linear_format)
        load_unit(unit, {block_prefix: self.block, own_prefix: self.own_tensors}, tensors)

    def own(self, component: str):
        return None  # the stages share the target's embeddings and head

    def context(self, taps: torch.Tensor) -> torch.Tensor:
        o = self.own_tensors
        return o.main_norm(o.main_proj(taps))

    def _rotary(self, starts: torch.Tensor, L: int, dtype):
        return self.block.self_attn.rotary(starts[:, None] + torch.arange(L, device=starts.device), dtype)

    def context_keys(self, ctx: torch.Tensor, start: int) -> torch.Tensor:
        a = self.block.self_attn
        B, S, _ = ctx.shape
        cos, sin = self._rotary(torch.full((B,), start, device=ctx.device), S, ctx.dtype)
        return rope_tail(a.kv_norm(a.kv_proj(ctx)), cos, sin)

    def _attend(self, h: torch.Tensor, keys: torch.Tensor, starts: torch.Tensor, visible) -> torch.Tensor:
        a, c = self.block.self_attn, self.c
        B, L, _ = h.shape
        cos, sin = self._rotary(starts, L, h.dtype)
        q = unweighted_rms_norm(a.q_b_proj(a.q_a_norm(a.q_a_proj(h))).view(B, L, a.heads, c.head_dim), c.eps)
        q = rope_tail(q, cos[:, :, None], sin[:, :, None])
        own = rope_tail(a.kv_norm(a.kv_proj(h)), cos, sin)
        return a._output(attend_block(q, own, keys, visible, a.sinks, a.scale), cos, sin)

    def forward(self, x: torch.Tensor, keys: torch.Tensor, starts: torch.Tensor, par: Group,
                visible: torch.Tensor | None = None) -> torch.Tensor:
        """The streams [B,L,hc,hidden] of B blocks (row b's at positions starts[b]..) through this stage."""
        b = self.block
        post, comb, h = b.attn_hc(x)
        x = spread(x, par.all_reduce(self._attend(b.input_layernorm(h), keys, starts, visible)), post, comb)
        post, comb, h = b.ffn_hc(x)
        return spread(x, par.all_reduce(b.mlp(b.post_attention_layernorm(h), None)), post, comb)

    def leave(self, x: torch.Tensor) -> torch.Tensor:
        return self.own_tensors.norm(hc_head_merge(x, self.own_tensors, self.c))

    def markov(self, prev: torch.Tensor) -> torch.Tensor:
        m = self.own_tensors.markov_head
        return F.linear(m.markov_w1.weight[prev].float(), m.markov_w2.weight.float())
