"""Manifold-constrained hyper-connections (DeepSeek-V4's decoder block, kind "mhc").

The residual is `hc_mult` streams per token ([B, S, n, hidden]). Around each sub-block (attention, then the
MoE) a HyperConnection computes, from the RMS-normed flattened streams, three mixings: `pre` (n weights:
the streams collapse into the sub-block's input), `post` (n weights: its output spreads back over the
streams) and `comb` (n x n, projected by Sinkhorn iterations towards a doubly-stochastic matrix: how the
streams carry over). The stack enters as n copies of the embedding and leaves through `hc_head` (a
`pre`-only mixing) before the final norm: MHCStack is what engine/model.py asks of the block kind."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import TextConfig
from engine.layers.slots import slot
from engine.models.deepseek_v4.cache import V4Cache
from engine.models.deepseek_v4.config import v4_config
from engine.models.deepseek_v4.norm import V4RMSNorm, unweighted_rms_norm
from kconvert.distributed import Group


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Alternate column / row normalisation of [..., n, n] (columns first and last)."""
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return comb


class HyperConnection(nn.Module):
    """`fn` [(2 + n) n, n hidden], `base` [(2 + n) n], `scale` [3] (pre, post, comb); float32 math."""

    def __init__(self, n: int, iters: int, eps: float, norm_eps: float):
        super().__init__()
        self.n, self.iters, self.eps, self.norm_eps = n, iters, eps, norm_eps
        slot(self, "fn")
        slot(self, "base")
        slot(self, "scale")

    def forward(self, streams: torch.Tensor):
        """(post [B,S,n], comb [B,S,n,n], the collapsed sub-block input [B,S,hidden]) from streams [B,S,n,hidden]."""
        n = self.n
        flat = unweighted_rms_norm(streams.flatten(2).float(), self.norm_eps)
        mixes = F.linear(flat, self.fn.float())
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([n, n, n * n])
        s_pre, s_post, s_comb = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre_w * s_pre + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * s_post + post_b)
        comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * s_comb + comb_b.view(n, n), dim=-1) + self.eps
        collapsed = (pre[..., None] * streams).sum(dim=2).to(streams.dtype)
        return post, sinkhorn(comb, self.iters, self.eps), collapsed


def spread(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams: post-weighted copies of the sub-block output plus comb^T mixing of the old streams."""
    dt = streams.dtype
    return post.to(dt)[..., None] * out[:, :, None] + torch.matmul(comb.to(dt).transpose(-1, -2), streams)


class MHCBlock(nn.Module):
    """`attn_hc`, `input_layernorm`, `self_attn`, `ffn_hc`, `post_attention_layernorm`, `mlp`: the attention and
    feed-forward modules are given (engine/models/registry.py builds the kinds the manifest names); the feed-forward
    one is called with the token ids too, for hash routing."""

    def __init__(self, cfg: TextConfig, attention: nn.Module, feed_forward: nn.Module):
        super().__init__()
        c = v4_config(cfg)
        self.attn_hc = HyperConnection(c.hc_mult, c.hc_iters, c.hc_eps, c.eps)
        self.ffn_hc = HyperConnection(c.hc_mult, c.hc_iters, c.hc_eps, c.eps)
        self.input_layernorm = V4RMSNorm(c.eps)
        self.post_attention_layernorm = V4RMSNorm(c.eps)
        self.self_attn = attention
        self.mlp = feed_forward

    def forward(self, x: torch.Tensor, start: int, cache, cos: torch.Tensor, sin: torch.Tensor, par: Group,
                ids: torch.Tensor | None = None) -> torch.Tensor:
        """x: the streams [B,S,n,hidden] at positions start..start+S-1; ids [B,S] the tokens there."""
        post, comb, h = self.attn_hc(x)
        a = par.all_reduce(self.self_attn.forward(self.input_layernorm(h), start, cache, cos, sin))
        x = spread(x, a, post, comb)
        post, comb, h = self.ffn_hc(x)
        return spread(x, par.all_reduce(self.mlp(self.post_attention_layernorm(h), ids)), post, comb)


class HyperHead(nn.Module):
    """`hc_fn` [n, n hidden], `hc_base` [n], `hc_scale` [1]: the final collapse of the streams."""

    def __init__(self, n: int, eps: float, norm_eps: float):
        super().__init__()
        self.eps, self.norm_eps = eps, norm_eps
        for name in ("hc_fn", "hc_base", "hc_scale"):
            slot(self, name, optional=True)  # a pipeline stage other than the last may not hold them

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = unweighted_rms_norm(streams.flatten(2).float(), self.norm_eps)
        mixes = F.linear(flat, self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.eps
        return (pre[..., None] * streams).sum(dim=2).to(streams.dtype)


class MHCStack:
    """How the residual enters and leaves an mHC stack, and its cache (engine/layers.PlainStack's interface)."""

    head_name = "hc_head"  # under the text model: `model.hc_head.hc_fn` ...

    def __init__(self, cfg: TextConfig):
        self.c = v4_config(cfg)
        self.residual_shape = (self.c.hc_mult, cfg.hidden_size)

    def residual_shape_at(self, layer: int) -> tuple[int, ...]:
        return self.residual_shape

    def reported(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :, None].expand(-1, -1, self.c.hc_mult, -1).contiguous()

    def make_head(self) -> nn.Module:
        return HyperHead(self.c.hc_mult, self.c.hc_eps, self.c.eps)

    def leave(self, head: nn.Module | None, x: torch.Tensor) -> torch.Tensor:
        return head(x)

    def new_cache(self, cfg: TextConfig, batch: int, max_len: int, dtype, device, reserve, kv, layers=None) -> V4Cache:
        return V4Cache(cfg.num_layers, batch, max_len, device, kv)
