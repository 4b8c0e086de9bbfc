"""Decoder layer kinds, by name: the one place a model family's layers are chosen.

A family's manifest names its kinds in `[family.engine]` (`block`, `attention`, `dense_mlp`, `moe`; the
defaults below are DeepSeek-V3/V3.2's); engine/config.py reads them into TextConfig. A family with new
layers adds their module (an nn.Module whose attribute paths are the stored tensor names, weights declared
with engine.layers.linear.LinearSlot / engine.layers.slots.slot) and one line in a table here; engine/model.py does not change.

Every kind is constructed as `cls(cfg, layer, par)`: the TextConfig (its `section` holds the config.json
keys a new kind reads), the decoder layer's index, the process group (tp rank and size). A block is called
as `forward(x, start, cache_layer, cos, sin, par, ids=None)` (ids: the token ids, for kinds that route by
them). A block kind's `stack` class says how the residual enters the decoder layers and leaves them, and
which cache its layers keep (PlainStack below); engine/model.py asks it, never the family."""

from __future__ import annotations

import torch
from torch import nn

from engine.models.deepseek_v3.mla import MLA
from engine.cache.latent import KVCache
from engine.config import TextConfig
from engine.layers.linear import RMSNorm
from engine.models.deepseek_v4.mhc import MHCBlock, MHCStack
from engine.models.deepseek_v3.moe import MLP, MoE
from engine.models.deepseek_v4.attention import V4Attention
from engine.models.deepseek_v4.moe import V4MoE
from engine.models.deepseek_v41.block import V41Block
from engine.models.kimi_linear.block import KimiDecoderLayer, kimi_attention
from engine.models.kimi_linear.config import kimi_config
from engine.models.kimi_linear.moe import KimiMLP, KimiMoE
from engine.models.deepseek_v41.vision import DeepseekAligner, DeepseekViT, span_length
from engine.models.kimi_k25.vision import Projector, VisionTower, tokens_per_image
from engine.models.kimi_linear.vision import PatchMergerV2, VisionTowerV2
from kconvert.distributed import Group
from kconvert.errors import EngineError

ATTENTION: dict[str, type[nn.Module]] = {
    "mla": MLA,  # DeepSeek MLA; with `index_topk` in the config, the DSA lightning indexer too
    "v4": V4Attention,  # DeepSeek-V4: shared-KV MQA + sliding window + sinks; CSA / HCA compressed branches
    "kimi_linear": kimi_attention,  # Kimi Linear / K3: KDA or gated NoPE MLA, by the layer's scheduled kind
}
FEED_FORWARD: dict[str, type[nn.Module]] = {
    "swiglu": MLP,  # the first `first_k_dense_replace` layers
    "deepseek_moe": MoE,  # sigmoid router + group-limited top-k + shared experts
    "v4_moe": V4MoE,  # DeepSeek-V4: sqrt(softplus) or hash routing, SwiGLU clamp, shared expert
    "kimi_mlp": KimiMLP,  # Kimi Linear / K3: SiTU (or SwiGLU) dense feed-forward
    "kimi_moe": KimiMoE,  # Kimi Linear / K3: sigmoid router on the full hidden, experts in the latent width
}


def kind(table: dict, name: str, what: str):
    if name not in table:
        raise EngineError(f"the engine has no {what} kind {name!r} (known: {', '.join(sorted(table))})",
                          file="kconvert.json")
    return table[name]


class PlainStack:
    """The residual is the hidden state itself, kept in the paged MLA cache (engine/cache/latent.py). A block kind
    with another residual (several streams, a merge before the final norm) gives its own class, with:
    `residual_shape` (per token), `residual_shape_at(layer)` (what a pipeline stage starting at `layer` receives,
    for a residual that grows along the layers), `reported(x)` (what verify compares per layer), `enter(x)` (from
    the embeddings), `make_head()` (a module stored as `model.<head_name>` in the globals unit, or None) and
    `leave(head, x)` (before the final norm), `new_cache(..., layers)` (the cache of a stage's layers)."""

    head_name: str | None = None

    def __init__(self, cfg: TextConfig):
        self.residual_shape = (cfg.hidden_size,)

    def residual_shape_at(self, layer: int) -> tuple[int, ...]:
        return self.residual_shape

    def reported(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def make_head(self) -> nn.Module | None:
        return None

    def leave(self, head: nn.Module | None, x: torch.Tensor) -> torch.Tensor:
        return x

    def new_cache(self, cfg: TextConfig, batch: int, max_len: int, dtype, device, reserve, kv, layers=None) -> KVCache:
        return KVCache(cfg, batch, max_len, dtype, device, reserve, kv)


class PreNormDecoderLayer(nn.Module):
    """x + attn(norm(x)), then x + mlp(norm(x)): `input_layernorm`, `self_attn`, `post_attention_layernorm`, `mlp`."""

    def __init__(self, cfg: TextConfig, layer: int, par: Group):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.rms_norm_eps)
        self.self_attn = kind(ATTENTION, cfg.attention_kind, "attention")(cfg, layer, par)
        self.post_attention_layernorm = RMSNorm(cfg.rms_norm_eps)
        mlp = cfg.moe_kind if cfg.is_moe(layer) else cfg.dense_mlp_kind
        self.mlp = kind(FEED_FORWARD, mlp, "feed-forward")(cfg, layer, par)

    stack = PlainStack

    def forward(self, x: torch.Tensor, start: int, cache, cos: torch.Tensor, sin: torch.Tensor, par: Group,
                ids: torch.Tensor | None = None):
        x = x + par.all_reduce(self.self_attn.forward(self.input_layernorm(x), start, cache, cos, sin))
        return x + par.all_reduce(self.mlp(self.post_attention_layernorm(x)))


class MHCDecoderLayer(MHCBlock):
    """DeepSeek-V4's block (engine/models/deepseek_v4/mhc.py) around the attention and MoE kinds the manifest names."""

    stack = MHCStack

    def __init__(self, cfg: TextConfig, layer: int, par: Group):
        super().__init__(cfg, kind(ATTENTION, cfg.attention_kind, "attention")(cfg, layer, par),
                         kind(FEED_FORWARD, cfg.moe_kind, "feed-forward")(cfg, layer, par))


class KimiLinearDecoderLayer(KimiDecoderLayer):
    """Kimi Linear's block (engine/models/kimi_linear/block.py) around the attention kind (KDA or MLA by layer) and
    the feed-forward kind (dense or MoE by layer) the manifest names."""

    def __init__(self, cfg: TextConfig, layer: int, par: Group):
        ffn = cfg.moe_kind if kimi_config(cfg).is_moe(layer) else cfg.dense_mlp_kind
        super().__init__(cfg, layer, kind(ATTENTION, cfg.attention_kind, "attention")(cfg, layer, par),
                         kind(FEED_FORWARD, ffn, "feed-forward")(cfg, layer, par))


BLOCK: dict[str, type[nn.Module]] = {
    "pre_norm": PreNormDecoderLayer,
    "mhc": MHCDecoderLayer,  # hc_mult residual streams mixed by hyper-connections (DeepSeek-V4)
    "kimi_linear": KimiLinearDecoderLayer,  # KDA / MLA + MoE; Kimi K3's block attention residuals
    "v41": V41Block,  # DeepSeek-V4.1: V4 attention with compression by role, Engram, single-pass mHC (its own kinds)
}


def block_stack(cfg: TextConfig):
    """The residual hooks of the family's block kind (PlainStack or the kind's own)."""
    return kind(BLOCK, cfg.block_kind, "decoder block").stack(cfg)


def decoder_layer(cfg: TextConfig, layer: int, par: Group) -> nn.Module:
    """Layer `layer`'s module, empty (its tensors arrive with its unit)."""
    return kind(BLOCK, cfg.block_kind, "decoder block")(cfg, layer, par)


VISION: dict[str, tuple[type[nn.Module], type[nn.Module], object]] = {  # [family.engine] vision ->
    # (tower, projector, text positions an image of (h, w) patches takes)
    "moonvit": (VisionTower, Projector, tokens_per_image),  # Kimi-K2.5
    "moonvit_v2": (VisionTowerV2, PatchMergerV2, tokens_per_image),  # Kimi K3: no biases, RMSNorm, a post-norm projector
    "deepseek_vit": (DeepseekViT, DeepseekAligner, span_length),  # DeepSeek-V4.1: the aligner builds the image span
}


def vision_modules(vc) -> tuple[nn.Module, nn.Module]:
    """The family's vision tower and projector, empty (their tensors arrive with the vision unit)."""
    tower, projector, _ = kind(VISION, vc.kind, "vision")
    return tower(vc), projector(vc)


def image_tokens(vc, grid_hw: tuple[int, int]) -> int:
    """Text positions an image of `grid_hw` patches takes under the family's vision kind."""
    return kind(VISION, vc.kind, "vision")[2](vc, grid_hw)
