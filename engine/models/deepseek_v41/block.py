"""DeepSeek-V4.1's decoder layer (block kind "v41", stored as `layers.N.*`) and how the residual runs through them.

The residual is `hc_mult` streams per token, as in V4 (engine/models/deepseek_v4/mhc.py), mixed by the same
hyper-connections (`hc_attn_fn/base/scale`, `hc_ffn_*`: pre / post / Sinkhorn-projected comb), but single-pass: the
collapse weights a sub-block computes are used by the next one. Attention collapses the streams with the weights
the previous layer's feed-forward made (the first layer: stream 0), and makes the ones its feed-forward uses; the
feed-forward makes the next layer's; after the last layer they collapse the streams for the final norm (no
`hc_head`). So the residual carries the streams and those pending weights: [B, S, hc, hidden + 1], the weights in
the last column (V41Stack). An Engram layer writes its n-gram lookup into the streams first."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.deepseek_v41.cache import V41Cache, V41LayerView
from engine.config import TextConfig
from engine.layers.slots import slot
from engine.models.deepseek_v4.mhc import sinkhorn, spread
from engine.models.deepseek_v4.norm import V4RMSNorm, unweighted_rms_norm
from engine.models.deepseek_v41.attention import V41Attention
from engine.models.deepseek_v41.config import V41Config, v41_config
from engine.models.deepseek_v41.crossing import incoming, outgoing
from engine.models.deepseek_v41.engram import Engram, EngramHashes
from engine.models.deepseek_v41.moe import V41MoE
from kconvert.distributed import Group


def mixes(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, c: V41Config):
    """(pre [B,S,n], post [B,S,n], comb [B,S,n,n]) from the streams [B,S,n,hidden], in float32."""
    n = c.hc_mult
    flat = unweighted_rms_norm(streams.flatten(2).float(), c.eps)
    m = F.linear(flat, fn.float())
    pre_w, post_w, comb_w = m.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    s_pre, s_post, s_comb = scale.float().unbind(0)
    pre = torch.sigmoid(pre_w * s_pre + pre_b) + c.hc_eps
    post = 2 * torch.sigmoid(post_w * s_post + post_b)
    comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * s_comb + comb_b.view(n, n), dim=-1) + c.hc_eps
    return pre, post, sinkhorn(comb, c.hc_iters, c.hc_eps)


def collapse(streams: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (weights[..., None].float() * streams.float()).sum(dim=2).to(streams.dtype)


class V41Block(nn.Module):
    """`attn_norm`, `attn`, `ffn_norm`, `ffn`, the two hyper-connections' `hc_*` tensors, `engram` on Engram layers."""

    def __init__(self, cfg: TextConfig, layer: int, par: Group):
        super().__init__()
        c = self.c = v41_config(cfg)
        self.layer, self.image_token = layer, cfg.image_token_id
        self.attn_norm, self.ffn_norm = V4RMSNorm(c.eps), V4RMSNorm(c.eps)
        self.attn = V41Attention(c, layer, par)
        self.ffn = V41MoE(c, par)
        for name in ("hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale"):
            slot(self, name)
        slot_ = c.engram_slot(layer)
        if slot_ >= 0:
            self.engram = Engram(c, c.engram_rows[slot_], par)

    stack = None  # set below (V41Stack)

    def forward(self, x: torch.Tensor, start: int, view: V41LayerView, cos, sin, par: Group,
                ids: torch.Tensor | None = None) -> torch.Tensor:
        """x: the residual [B, S, hc, hidden + 1] at positions start.. (ids [B, S]: the tokens there)."""
        c, H = self.c, self.c.hidden
        streams, pending = x[..., :H], x[..., H].float()
        image = None if ids is None or self.image_token is None else ids == self.image_token
        if hasattr(self, "engram"):
            rows = view.handoff.engram_rows(ids, image, start)[:, :, c.engram_slot(self.layer)]
            streams = self.engram(streams, rows, None if image is None else ~image, par)
        return through(self, streams, pending, lambda h: self.attn(h, start, view), image, par)


def through(block: nn.Module, streams: torch.Tensor, pending: torch.Tensor, attend, image, par: Group) -> torch.Tensor:
    """A V4.1 block's two sub-blocks over its streams [B,S,hc,hidden] (`pending`: the collapse weights the previous
    sub-block made), attention given as `attend(normed input)` (this rank's partial output): the residual out,
    [B,S,hc,hidden + 1]. The decoder layers' and the DSpark stages' (engine/draft/dspark.py) alike."""
    c = block.c
    attn_pre, post, comb = mixes(streams, block.hc_attn_fn, block.hc_attn_base, block.hc_attn_scale, c)
    h = block.attn_norm(collapse(streams, pending))
    streams = spread(streams, par.all_reduce(attend(h)), post, comb)
    ffn_pre, post, comb = mixes(streams, block.hc_ffn_fn, block.hc_ffn_base, block.hc_ffn_scale, c)
    h = block.ffn_norm(collapse(streams, attn_pre))
    streams = spread(streams, par.all_reduce(block.ffn(h, image)), post, comb)
    return torch.cat([streams, ffn_pre.to(streams.dtype)[..., None]], -1)


class V41Stack:
    """How the residual enters and leaves V4.1's layers, and their cache (engine/models/registry.py's interface)."""

    head_name = None  # no hc_head: the last layer's pending weights collapse the streams

    def __init__(self, cfg: TextConfig):
        self.c = v41_config(cfg)
        self.section, self.key_prefix = cfg.section, cfg.key_prefix  # the token map is checked against them
        self.residual_shape = (self.c.hc_mult, cfg.hidden_size + 1)
        self.hashes: EngramHashes | None = None
        self.token_map_file = None

    def attach(self, root) -> None:
        """The converted checkpoint's directory: its engram_token_map.json (Engram layers hash through it)."""
        from engine.models.deepseek_v41.engram_tokens import read_token_map

        if self.c.engram_layers:
            self.hashes = EngramHashes(self.c, read_token_map(root, self.section, self.key_prefix))

    def crossing(self, model, cache: V41Cache, start: int, S: int) -> torch.Tensor | None:
        """What this stage sends the next beside the residual (engine/models/deepseek_v41/crossing.py)."""
        return outgoing(self.c, cache, model.stages[model.par.stage + 1][0], start, S, model.dtype)

    def receive_crossing(self, model, cache: V41Cache, start: int, S: int) -> None:
        incoming(self.c, cache, model.stage_layers[0], start, S, model.dtype,
                 lambda n: model.par.recv_prev((n,), torch.uint8, model.device))

    def alone(self, fresh: V41Cache, ran: V41Cache, layer: int) -> V41Cache:
        """`fresh` (a new cache of the stage) holding what a forward over the same tokens (`ran`) left for `layer`
        from the other layers: their entries and keys, the indexers' choices, the candidate blocks. Run alone on
        its input with it, the layer computes what it did in that forward (verify's attribution)."""
        hand, done = fresh.handoff, ran.handoff
        hand.states.update({L: st for L, st in done.states.items() if L != layer})
        hand.chosen.update({L: c for L, c in done.chosen.items() if L != layer})
        if self.c.candidate_source != layer:
            hand.candidates = done.candidates
        return fresh

    def residual_shape_at(self, layer: int) -> tuple[int, ...]:
        return self.residual_shape

    def reported(self, x: torch.Tensor) -> torch.Tensor:
        return x[..., :self.c.hidden]

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        B, S, H = x.shape
        pending = torch.zeros(B, S, self.c.hc_mult, 1, dtype=x.dtype, device=x.device)
        pending[:, :, 0] = 1  # the first layer's attention reads stream 0
        return torch.cat([x[:, :, None].expand(B, S, self.c.hc_mult, H), pending], -1)

    def make_head(self) -> nn.Module | None:
        return None

    def leave(self, head, x: torch.Tensor) -> torch.Tensor:
        return collapse(x[..., :self.c.hidden], x[..., self.c.hidden].float())

    def new_cache(self, cfg: TextConfig, batch: int, max_len: int, dtype, device, reserve, kv, layers=None) -> V41Cache:
        return V41Cache(list(layers if layers is not None else range(cfg.num_layers)), batch, max_len, device, kv,
                        hashes=self.hashes, ratios=self.c.ratios)


V41Block.stack = V41Stack
