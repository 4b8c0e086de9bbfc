"""Decoder layer kinds, by name: the one place a model family's layers are chosen.

A family's manifest names its kinds in `[family.engine]` (`block`, `attention`, `dense_mlp`, `moe`; the
defaults below are DeepSeek-V3/V3.2's); engine/config.py reads them into TextConfig. A family with new
layers adds their module (an nn.Module whose attribute paths are the stored tensor names, weights declared
with engine.linear.LinearSlot / engine.slots.slot) and one line in a table here; engine/model.py does not change.

Every kind is constructed as `cls(cfg, layer, par)`: the TextConfig (its `section` holds the config.json
keys a new kind reads), the decoder layer's index, the process group (tp rank and size)."""

from __future__ import annotations

import torch
from torch import nn

from engine.attention import MLA
from engine.config import TextConfig
from engine.linear import RMSNorm
from engine.moe import MLP, MoE
from kconvert.distributed import Group
from kconvert.errors import EngineError

ATTENTION: dict[str, type[nn.Module]] = {
    "mla": MLA,  # DeepSeek MLA; with `index_topk` in the config, the DSA lightning indexer too
}
FEED_FORWARD: dict[str, type[nn.Module]] = {
    "swiglu": MLP,  # the first `first_k_dense_replace` layers
    "deepseek_moe": MoE,  # sigmoid router + group-limited top-k + shared experts
}


def kind(table: dict, name: str, what: str):
    if name not in table:
        raise EngineError(f"the engine has no {what} kind {name!r} (known: {', '.join(sorted(table))})",
                          file="kconvert.json")
    return table[name]


class PreNormDecoderLayer(nn.Module):
    """x + attn(norm(x)), then x + mlp(norm(x)): `input_layernorm`, `self_attn`, `post_attention_layernorm`, `mlp`."""

    def __init__(self, cfg: TextConfig, layer: int, par: Group):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.rms_norm_eps)
        self.self_attn = kind(ATTENTION, cfg.attention_kind, "attention")(cfg, layer, par)
        self.post_attention_layernorm = RMSNorm(cfg.rms_norm_eps)
        mlp = cfg.moe_kind if cfg.is_moe(layer) else cfg.dense_mlp_kind
        self.mlp = kind(FEED_FORWARD, mlp, "feed-forward")(cfg, layer, par)

    def forward(self, x: torch.Tensor, start: int, cache, cos: torch.Tensor, sin: torch.Tensor, par: Group):
        x = x + par.all_reduce(self.self_attn.forward(self.input_layernorm(x), start, cache, cos, sin))
        return x + par.all_reduce(self.mlp(self.post_attention_layernorm(x)))


BLOCK: dict[str, type[nn.Module]] = {
    "pre_norm": PreNormDecoderLayer,
}


def decoder_layer(cfg: TextConfig, layer: int, par: Group) -> nn.Module:
    """Layer `layer`'s module, empty (its tensors arrive with its unit)."""
    return kind(BLOCK, cfg.block_kind, "decoder block")(cfg, layer, par)
