"""Kimi Linear's decoder block (kind "kimi_linear") and how the residual enters and leaves a stack of them.

Each layer has an attention (KDA or gated NoPE MLA: the layer's kind, from the manifest's schedule) and a
feed-forward (`mlp` on dense layers, `block_sparse_moe` on MoE layers), each behind an RMSNorm. Kimi-Linear-48B
adds their outputs to a plain residual. Kimi K3's block attention residuals (`attn_res_block_size`) keep, per
token, the completed block sums (block 0 is the embedding) and a running partial sum of sublayer outputs:
before each sublayer the sources are mixed by softmax weights from ⟨v / rms(v), norm_w ⊙ proj_w⟩
(`self_attention_res_*`, `mlp_res_*`), and at a block's first layer the partial sum closes into a block;
the stack leaves through the `output_attn_res_*` mix. The residual is therefore [B, S, blocks + 1, hidden],
the partial last: its length grows along the layers, so pipeline stages pass the whole block list
(`residual_shape_at`), and what verify reports per layer is the partial sum (`reported`)."""

from __future__ import annotations

import torch
from torch import nn

from engine.models.kimi_linear.cache import HybridCache
from engine.config import TextConfig
from engine.layers.linear import RMSNorm
from engine.models.deepseek_v3.mla import MLA
from engine.models.kimi_linear.config import MLA_NORM_EPS, kimi_config
from engine.layers.slots import Stored
from engine.models.kimi_linear.kda import KDA
from engine.models.kimi_linear.ops import attn_res_logit_weights, attn_res_mix
from kconvert.distributed import Group


def kimi_attention(cfg: TextConfig, layer: int, par: Group) -> nn.Module:
    """Attention kind "kimi_linear": KDA on the layers the schedule says, else MLA (no rotation where the config
    says `mla_use_nope`, a sigmoid output gate where `mla_use_output_gate`)."""
    k = kimi_config(cfg)
    if k.kda_layers[layer]:
        return KDA(cfg, layer, par)
    return MLA(cfg, layer, par, nope=k.mla_nope, gated=k.mla_gate, norm_eps=MLA_NORM_EPS)


class ResidualMix(nn.Module):
    """`<name>_norm.weight` and `<name>_proj.weight` of one attention-residual mix, held as `norm` / `proj`."""

    def __init__(self, eps: float, optional: bool = False):
        super().__init__()
        self.eps = eps
        self.norm, self.proj = Stored(optional), Stored(optional)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, S, K + 1, hidden]: the mix of the K blocks and the partial sum (last)."""
        w = attn_res_logit_weights(self.norm.weight, self.proj.weight)
        return attn_res_mix(x[..., :-1, :].movedim(-2, 0), x[..., -1, :], w, self.eps)


class KimiDecoderLayer(nn.Module):
    """`input_layernorm`, `self_attn`, `post_attention_layernorm`, `mlp` or `block_sparse_moe` (the attention and
    feed-forward modules are given: engine/models/registry.py builds the kinds the manifest names) and, with
    attention residuals, `self_attention_res_{norm,proj}`, `mlp_res_{norm,proj}`."""

    def __init__(self, cfg: TextConfig, layer: int, attention: nn.Module, feed_forward: nn.Module):
        super().__init__()
        k = self.k = kimi_config(cfg)
        self.layer = layer
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(k.eps), RMSNorm(k.eps)
        self.self_attn = attention
        self.ffn_name = "block_sparse_moe" if k.is_moe(layer) else "mlp"
        setattr(self, self.ffn_name, feed_forward)
        if k.attn_res_block:  # held as the stored names' own modules: `self_attention_res_norm` ...
            self.self_attention_res_norm, self.self_attention_res_proj = Stored(), Stored()
            self.mlp_res_norm, self.mlp_res_proj = Stored(), Stored()

    stack = staticmethod(lambda cfg: KimiStack(cfg))

    def _mix(self, norm: Stored, proj: Stored, blocks: torch.Tensor, partial: torch.Tensor) -> torch.Tensor:
        w = attn_res_logit_weights(norm.weight, proj.weight)
        return attn_res_mix(blocks.movedim(-2, 0), partial, w, self.k.eps)

    def forward(self, x: torch.Tensor, start: int, cache, cos, sin, par: Group, ids=None) -> torch.Tensor:
        ffn = getattr(self, self.ffn_name)
        if not self.k.attn_res_block:
            x = x + par.all_reduce(self.self_attn.forward(self.input_layernorm(x), start, cache, cos, sin))
            return x + par.all_reduce(ffn(self.post_attention_layernorm(x)))
        blocks, partial = x[..., :-1, :], x[..., -1, :]
        h = self._mix(self.self_attention_res_norm, self.self_attention_res_proj, blocks, partial)
        y = par.all_reduce(self.self_attn.forward(self.input_layernorm(h), start, cache, cos, sin))
        if self.layer % self.k.attn_res_block == 0:  # a block closes before this layer's sublayers add to it
            blocks = torch.cat([blocks, partial[..., None, :]], dim=-2)
            partial = y
        else:
            partial = partial + y
        h = self._mix(self.mlp_res_norm, self.mlp_res_proj, blocks, partial)
        partial = partial + par.all_reduce(ffn(self.post_attention_layernorm(h)))
        return torch.cat([blocks, partial[..., None, :]], dim=-2)


class KimiStack:
    """The residual of a Kimi Linear stack (engine/models/registry.PlainStack's interface): plain, or K3's
    blocks + partial sum; its cache keeps MLA layers' latent rows and KDA layers' states (HybridCache)."""

    def __init__(self, cfg: TextConfig):
        self.k = kimi_config(cfg)
        self.block = self.k.attn_res_block
        # K3's final mix, under the text model: `model.output_attn_res.norm.weight` ... (a plain stack has none)
        self.head_name = "output_attn_res" if self.block else None
        self.hidden = cfg.hidden_size
        self.residual_shape = (1, cfg.hidden_size) if self.block else (cfg.hidden_size,)

    def residual_shape_at(self, layer: int) -> tuple[int, ...]:
        """Per token, the residual entering `layer`: the blocks closed before it, and the partial sum."""
        if not self.block:
            return self.residual_shape
        return (-(-layer // self.block) + 1, self.hidden)

    def reported(self, x: torch.Tensor) -> torch.Tensor:
        """What verify compares of a residual: the partial sum (all of a plain one)."""
        return x[..., -1, :] if self.block else x

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :, None] if self.block else x

    def make_head(self) -> nn.Module | None:
        return ResidualMix(self.k.eps, optional=True) if self.block else None  # optional: the last stage holds it

    def leave(self, head: nn.Module | None, x: torch.Tensor) -> torch.Tensor:
        return head(x) if self.block else x

    def new_cache(self, cfg: TextConfig, batch: int, max_len: int, dtype, device, reserve, kv, layers=None):
        kinds = ["kda" if self.k.kda_layers[L] else "mla" for L in (layers if layers is not None else range(cfg.num_layers))]
        return HybridCache(cfg, kinds, batch, max_len, dtype, device, reserve, kv)
