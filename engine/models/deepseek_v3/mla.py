"""MLA attention in the absorbed form over the latent cache, with DSA sparse selection.

Queries are projected into the latent space through kv_b's key half (q_nope · W_uk), scored against the
cached latent + rope key, and the attended latent is projected out through kv_b's value half. With a DSA
indexer each query gathers only its top-k latent entries (O(k) per query); without one (deepseek_v3) it
attends causally over the whole cache. The cache is paged (engine/cache/latent.py): every read goes through
the step's row map, so ragged batches and the host tier need nothing here."""

from __future__ import annotations

import torch
from torch import nn

from engine.cache.latent import LayerKV
from engine.config import TextConfig
from engine.models.deepseek_v3.dsa_indexer import Indexer
from engine.layers.linear import LinearSlot, RMSNorm
from engine.layers.rope import rotate_interleaved, softmax_scale
from kconvert.distributed import Group
from kconvert.errors import CheckpointError, EngineError

GATHER_BUDGET = 1 << 26  # elements of gathered latent rows held at once during prefill


class MLA(nn.Module):
    """Stored as `q_a_proj`, `q_a_layernorm`, `q_b_proj` (or `q_proj` without a q LoRA), `kv_a_proj_with_mqa`,
    `kv_a_layernorm`, `kv_b_proj`, `o_proj` and, with DSA, `indexer`. Kimi Linear's MLA (engine/models/kimi_linear)
    builds it with `nope` (the rope slice of queries and keys is not rotated), `gated` (the attention output times
    σ(`g_proj` x) before o_proj) and its own layernorm eps."""

    def __init__(self, cfg: TextConfig, layer: int, par: Group, *, nope: bool = False, gated: bool = False,
                 norm_eps: float | None = None):
        super().__init__()
        for key in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            if not getattr(cfg, key):
                raise CheckpointError(f"{cfg.key_prefix}{key} is 0 or absent: the engine's MLA needs it",
                                      file=cfg.config_file)
        if cfg.num_heads % par.tp:
            raise EngineError(f"{cfg.num_heads} heads do not split over tp={par.tp}")
        self.cfg, self.heads = cfg, cfg.num_heads // par.tp
        self.eps = cfg.rms_norm_eps if norm_eps is None else norm_eps
        self.nope = nope
        if cfg.q_lora_rank:
            self.q_a_proj = LinearSlot()
            self.q_a_layernorm = RMSNorm(self.eps)
            self.q_b_proj = LinearSlot()
        else:
            self.q_proj = LinearSlot()
        self.kv_a_proj_with_mqa = LinearSlot()
        self.kv_a_layernorm = RMSNorm(self.eps)
        self.kv_b_proj = LinearSlot()
        self.o_proj = LinearSlot()
        self.g_proj = LinearSlot() if gated else None
        self.indexer = Indexer(cfg) if cfg.index_topk else None
        self.scale = cfg.qk_head_dim ** -0.5 if nope else softmax_scale(cfg.rope, cfg.qk_head_dim)

    def forward(self, x: torch.Tensor, start: int, cache: LayerKV, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B,S,hidden] at positions start..start+S-1; returns this rank's partial o_proj output."""
        c = self.cfg
        B, S, _ = x.shape
        dt = x.dtype
        nope, rope, lat = c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank
        if c.q_lora_rank:
            q_lat = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_lat)
        else:
            q_lat, q = None, self.q_proj(x)
        q = q.view(B, S, self.heads, nope + rope)
        kv = self.kv_a_proj_with_mqa(x)
        if self.nope:
            q_rope, k_rope = q[..., nope:], kv[..., lat:]
        else:
            q_rope, k_rope = rotate_interleaved(q[..., nope:], cos[:, :, None], sin[:, :, None]), rotate_interleaved(
                kv[..., lat:], cos, sin)
        step = cache.step_for(start, B, S)
        cache.write(step, self.kv_a_layernorm(kv[..., :lat]), k_rope)

        wkv = self.kv_b_proj.dense(dt).view(self.heads, nope + c.v_head_dim, lat)
        q_abs = torch.einsum("bshd,hdc->bshc", q[..., :nope], wkv[:, :nope])  # [B,S,h,lat]
        if self.indexer is not None:
            idx, valid = self.indexer.select(x, q_lat, cache, step, cos, sin)
            o_lat = self._sparse(q_abs, q_rope, cache, step.rows, idx, valid)
        else:
            o_lat = self._dense(q_abs, q_rope, cache, step)
        o = torch.einsum("bshc,hvc->bshv", o_lat, wkv[:, nope:]).reshape(B, S, self.heads * c.v_head_dim)
        if self.g_proj is not None:
            o = o * torch.sigmoid(self.g_proj(x))
        return self.o_proj(o)

    def _sparse(self, q_abs, q_rope, cache: LayerKV, rows, idx, valid):
        """Only the selected latent rows are read (and, with the host tier, fetched)."""
        B, S, h, lat = q_abs.shape
        k = idx.shape[-1]
        out = torch.empty_like(q_abs)
        chunk = max(1, GATHER_BUDGET // max(1, B * k * (lat + self.cfg.qk_rope_head_dim)))
        for s0 in range(0, S, chunk):
            s1 = min(S, s0 + chunk)
            sel = rows.gather(1, idx[:, s0:s1].flatten(1)).view(B, s1 - s0, k)
            lat_g, rope_g = cache.read(sel, q_abs.dtype)  # [B,s,k,lat], [B,s,k,rope]
            scores = torch.einsum("bshc,bskc->bshk", q_abs[:, s0:s1], lat_g)
            scores += torch.einsum("bshr,bskr->bshk", q_rope[:, s0:s1], rope_g)
            scores = (scores * self.scale).masked_fill(~valid[:, s0:s1, None, :], float("-inf"))
            p = torch.softmax(scores.float(), dim=-1).to(q_abs.dtype)
            out[:, s0:s1] = torch.einsum("bshk,bskc->bshc", p, lat_g)
        return out

    def _dense(self, q_abs, q_rope, cache: LayerKV, step):
        """No indexer (deepseek_v3): every earlier position, each sequence masked at its own length."""
        B, S, h, lat = q_abs.shape
        latent, k_rope = cache.read(step.rows, q_abs.dtype)  # [B,T,lat], [B,T,rope]
        T = latent.shape[1]
        out = torch.empty_like(q_abs)
        chunk = max(1, GATHER_BUDGET // max(1, B * h * T))
        keys = torch.arange(T, device=q_abs.device)
        for s0 in range(0, S, chunk):
            s1 = min(S, s0 + chunk)
            scores = torch.einsum("bshc,btc->bsht", q_abs[:, s0:s1], latent)
            scores += torch.einsum("bshr,btr->bsht", q_rope[:, s0:s1], k_rope)
            future = keys[None, None, :] > step.positions[:, s0:s1, None]  # [B,s,T]
            scores = (scores * self.scale).masked_fill(future[:, :, None, :], float("-inf"))
            p = torch.softmax(scores.float(), dim=-1).to(q_abs.dtype)
            out[:, s0:s1] = torch.einsum("bsht,btc->bshc", p, latent)
        return out
