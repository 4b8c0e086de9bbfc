"""Kimi Delta Attention (a KDA layer of Kimi Linear / Kimi K3): the gated delta rule with a per-channel decay,
over a fixed-size recurrent state per sequence instead of a KV cache (engine/models/kimi_linear/cache.py).

q, k and v each go through a width-K causal depthwise conv + SiLU (the conv keeps the last K-1 inputs per
sequence), q and k are L2-normalised (q scaled by head_dim^-0.5), the decay g comes from `f_a_proj`, `f_b_proj`,
`A_log` and `dt_bias`, β = σ(`b_proj` x); prefill runs chunk by chunk, one-token decode step by step from the
state (engine/models/kimi_linear/ops.py). The output is RMS-normed per head (`o_norm`), gated by σ(`g_proj` x)
(or the low-rank `g_a_proj` / `g_b_proj`) and projected by `o_proj`.

Tensor parallel: this rank holds its heads' rows of every per-head tensor (q/k/v projections and convs, f_b,
b, the gate, dt_bias) and their columns of o_proj; A_log is replicated (stored as [head_dim] by Kimi K3 with the
first num_heads used, or [1, 1, heads, 1]) and the rank takes its heads' entries."""

from __future__ import annotations

import torch
from torch import nn

from engine.config import TextConfig
from engine.layers.linear import LinearSlot, RMSNorm
from engine.layers.slots import Stored, slot
from engine.models.kimi_linear.config import L2_NORM_EPS, kimi_config
from engine.models.kimi_linear.ops import kda_chunked, kda_gate, kda_recurrent, l2_normalize_qk, short_conv
from kconvert.distributed import Group
from kconvert.errors import EngineError


class KDA(nn.Module):
    def __init__(self, cfg: TextConfig, layer: int, par: Group):
        super().__init__()
        k = self.k = kimi_config(cfg)
        if k.kda_heads % par.tp:
            raise EngineError(f"{k.kda_heads} KDA heads do not split over tp={par.tp}")
        self.heads, self.head_dim = k.kda_heads // par.tp, k.kda_head_dim
        self.first_head = par.tp_rank * self.heads
        self.q_proj, self.k_proj, self.v_proj = LinearSlot(), LinearSlot(), LinearSlot()
        self.q_conv1d, self.k_conv1d, self.v_conv1d = Stored(), Stored(), Stored()
        self.f_a_proj, self.f_b_proj, self.b_proj = LinearSlot(), LinearSlot(), LinearSlot()
        slot(self, "A_log")
        slot(self, "dt_bias")
        if k.full_rank_gate:
            self.g_proj = LinearSlot()
        else:
            self.g_a_proj, self.g_b_proj = LinearSlot(), LinearSlot()
        self.o_norm = RMSNorm(k.eps)
        self.o_proj = LinearSlot()

    def forward(self, x: torch.Tensor, start: int, cache, cos=None, sin=None) -> torch.Tensor:
        """x [B,S,hidden] at positions start..start+S-1; returns this rank's partial o_proj output."""
        B, S, _ = x.shape
        h, D = self.heads, self.head_dim
        step = cache.step_for(start, B, S)
        conv_state, state = cache.read(step)
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        kernel = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight])[:, 0]  # [3P, K]
        qkv, conv_state = short_conv(qkv, kernel, conv_state)
        q, k, v = (t.reshape(B, S, h, D) for t in qkv.split(h * D, dim=-1))
        q, k = l2_normalize_qk(q, k, D ** -0.5, L2_NORM_EPS)
        a = self.f_b_proj(self.f_a_proj(x)).view(B, S, h, D)
        A_log = self.A_log.reshape(-1)[self.first_head:self.first_head + h]
        g = kda_gate(a, A_log, self.dt_bias.view(h, D), self.k.lower_bound)
        beta = torch.sigmoid(self.b_proj(x).float())
        run = kda_recurrent if S == 1 else kda_chunked  # decode: one step from the state, whatever the context
        o, state = run(q, k, v, g, beta, state)
        cache.write(step, conv_state, state)
        gate = self.g_proj(x) if self.k.full_rank_gate else self.g_b_proj(self.g_a_proj(x))
        o = self.o_norm(o.to(x.dtype)) * torch.sigmoid(gate.view(B, S, h, D))
        return self.o_proj(o.reshape(B, S, h * D))
