"""DeepSeek-V4's MTP block (draft kind "v4_mtp"): `mtp.{M}.*` as released. One V4 decoder block (sliding-window
attention only, top-k routed MoE: the trailing 0 of `compress_ratios`), stored with the decoder layers' names
(the engine keeps it under `model.layers.{num_hidden_layers + M}.`, as kconvert/family/engine_names.py maps
it), plus its own `e_proj`, `h_proj`, `enorm`, `hnorm`, `norm` and `hc_head_{fn,base,scale}` under `mtp.{M}.`.
It has no embeddings or head: the target's are used (draft_shares).

At position i it reads the target's residual streams after the last layer (before their hc_head merge,
[B,S,hc_mult,hidden]) and the embedding of the next token: x = e_proj(enorm(embed(t[i+1]))) + h_proj(hnorm(h[i]))
per stream -> the block, its mHC residual and own KV cache -> its own hc_head merge -> norm -> the head. The
block's output streams are what a chained draft feeds back (mlx-vlm's deepseek_v4_mtp drafter does the same)."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import TextConfig
from engine.layers.linear import LinearSlot, resolve_linears
from engine.layers.slots import load_unit, slot
from engine.models.deepseek_v4.config import v4_config
from engine.models.deepseek_v4.norm import V4RMSNorm, unweighted_rms_norm
from engine.models.registry import decoder_layer
from kconvert.distributed import Group


def mtp_block_config(cfg: TextConfig, layer: int) -> TextConfig:
    """cfg with layer `layer` a sliding-window, top-k routed layer (what the released MTP block is, whichever
    spelling the config's schedule uses)."""
    n = layer + 1
    section = {**cfg.section, "layer_types": None, "compress_ratios": [0] * n, "mlp_layer_types": ["moe"] * n}
    return replace(cfg, num_layers=n, section=section)


class V4MTPHead(nn.Module):
    def __init__(self, cfg: TextConfig, layer: int, par: Group):
        super().__init__()
        self.layer, self.cfg = layer, cfg
        c = self.c = v4_config(cfg)
        self.block = decoder_layer(mtp_block_config(cfg, layer), layer, par)
        own = self.own_tensors = nn.Module()  # mtp.{M}.*: attribute paths are the stored names under it
        own.e_proj, own.h_proj = LinearSlot(), LinearSlot()
        own.enorm, own.hnorm, own.norm = V4RMSNorm(c.eps), V4RMSNorm(c.eps), V4RMSNorm(c.eps)
        for name in ("hc_head_fn", "hc_head_base", "hc_head_scale"):
            slot(own, name)

    def load(self, unit: str, tensors: dict, block_prefix: str, own_prefix: str, linear_format) -> None:
        resolve_linears(self.block, block_prefix, linear_format)
        resolve_linears(self.own_tensors, own_prefix, linear_format)
        load_unit(unit, {block_prefix: self.block, own_prefix: self.own_tensors}, tensors)

    def own(self, component: str):
        return None  # V4's MTP block shares the target's embeddings and head

    def new_cache(self, model, batch: int, max_len: int, kv):
        from engine.models.deepseek_v4.cache import V4Cache

        return V4Cache(1, batch, max_len, model.device, kv)

    def from_target(self, model, x: torch.Tensor) -> torch.Tensor:
        return x  # the streams themselves, before the target's hc_head

    def merge(self, streams: torch.Tensor) -> torch.Tensor:
        return hc_head_merge(streams, self.own_tensors, self.c)

    def forward(self, ctx, hidden: torch.Tensor, tokens: torch.Tensor, start: int, cache):
        """(normed [B,S,hidden] for the head, carry [B,S,hc_mult,hidden]) at positions start.. of the streams
        hidden [B,S,hc_mult,hidden] and the tokens after them [B,S]."""
        o = self.own_tensors
        B, S = tokens.shape
        e = o.e_proj(o.enorm(ctx.embed(tokens, None)))
        x = e[:, :, None] + o.h_proj(o.hnorm(hidden.to(e.dtype)))
        step = cache.begin(S)
        x = self.block(x, start, cache.layers[0], None, None, ctx.par, ids=tokens)
        cache.commit(step)
        return o.norm(self.merge(x)), x


def hc_head_merge(streams: torch.Tensor, own: nn.Module, c) -> torch.Tensor:
    """A draft block's own hc_head (`own.hc_head_{fn,base,scale}`): a `pre`-only mixing of the streams
    [B,S,n,hidden] (engine/models/deepseek_v4/mhc.HyperHead). V4's MTP block and DSpark's last stage alike."""
    flat = unweighted_rms_norm(streams.flatten(2).float(), c.eps)
    pre = torch.sigmoid(F.linear(flat, own.hc_head_fn.float()) * own.hc_head_scale.float() + own.hc_head_base.float())
    return ((pre + c.hc_eps)[..., None] * streams).sum(dim=2).to(streams.dtype)
