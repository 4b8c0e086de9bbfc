"""DeepSeek-V3-style multi-token prediction (draft kind "mtp": DeepSeek-V3 / V3.2, Kimi-K2 / K2.5 text): layer L
past the decoder layers is one decoder block of the family's kind plus, stored beside it under the same
`model.layers.{L}.` prefix, `enorm`, `hnorm`, `eh_proj` and `shared_head.norm` (and, in DeepSeek-V3's release,
copies of the embeddings and head: `embed_tokens`, `shared_head.head`; absent, the target's are used).

At position i it reads the target's output there (after the final norm, as vLLM and SGLang feed it) and the
embedding of the token after it: x = eh_proj([enorm(embed(t[i+1])); hnorm(h[i])]) -> the block (with its own
KV cache) -> shared_head.norm -> the head: the token after t[i+1]. The block's output (before the norm) is
what a chained draft feeds back in place of h."""

from __future__ import annotations

import torch
from torch import nn

from engine.config import TextConfig
from engine.layers.linear import LinearSlot, RMSNorm, resolve_linears
from engine.layers.slots import Stored, load_unit
from engine.models.registry import decoder_layer
from kconvert.distributed import Group


class MTPHead(nn.Module):
    def __init__(self, cfg: TextConfig, layer: int, par: Group):
        super().__init__()
        self.layer, self.cfg = layer, cfg
        eps = cfg.rms_norm_eps
        block = decoder_layer(cfg, layer, par)  # the family's decoder block; the MTP extras sit beside its modules
        block.enorm, block.hnorm = RMSNorm(eps), RMSNorm(eps)
        block.eh_proj = LinearSlot()
        block.shared_head = nn.Module()
        block.shared_head.norm = RMSNorm(eps)
        block.shared_head.head = LinearSlot()
        block.embed_tokens = Stored(optional=True)
        self.block = block

    def load(self, unit: str, tensors: dict, block_prefix: str, own_prefix: str, linear_format) -> None:
        b = self.block
        if not any(n.startswith(f"{block_prefix}shared_head.head.") for n in tensors):
            b.shared_head.head = None  # the target's head is used (draft_shares)
        resolve_linears(b, block_prefix, linear_format)
        load_unit(unit, {block_prefix: b}, tensors)

    def own(self, component: str):
        """This head's own copy of a shared target tensor ("embed": a weight, "head": a linear), or None."""
        b = self.block
        return b.embed_tokens.weight if component == "embed" else b.shared_head.head

    def new_cache(self, model, batch: int, max_len: int, kv):
        from dataclasses import replace

        from engine.cache.latent import KVCache

        return KVCache(replace(self.cfg, num_layers=1), batch, max_len, model.dtype, model.device, None, kv)

    def from_target(self, model, x: torch.Tensor) -> torch.Tensor:
        """The head's input form of the target's last-stage residual: its final-norm output."""
        return model.final_norm(x)

    def forward(self, ctx, hidden: torch.Tensor, tokens: torch.Tensor, start: int, cache):
        """(normed [B,S,hidden] for the head, carry [B,S,hidden] for a chained draft) at positions start.. of
        hidden [B,S,hidden] (the target's, or a carry) and the tokens after them [B,S]."""
        b = self.block
        B, S = tokens.shape
        e = b.enorm(ctx.embed(tokens, b.embed_tokens.weight))
        x = b.eh_proj(torch.cat([e, b.hnorm(hidden.to(e.dtype))], -1))
        step = cache.begin(S)
        cos, sin = ctx.rotary(step.positions, x.dtype)
        x = b(x, start, cache.layers[0], cos, sin, ctx.par, ids=tokens)
        cache.commit(step)
        return b.shared_head.norm(x), x
