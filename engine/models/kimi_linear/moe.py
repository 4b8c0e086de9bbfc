"""Kimi Linear's feed-forward kinds: the dense MLP ("kimi_mlp") and the MoE ("kimi_moe"), with SiTU where the
config says `hidden_act: situ` (Kimi K3) and SwiGLU otherwise (Kimi-Linear-48B).

The MoE's router is DeepSeek's (sigmoid scores, top-k on score + e_score_correction_bias, weights from the raw
scores renormalised, × routed_scaling_factor) and reads the full hidden; with a latent width
(`routed_expert_hidden_size`, Kimi K3) the routed experts run in it: z = routed_expert_down_proj(x), the experts
on z, their weighted sum, RMSNorm (`routed_expert_norm`), routed_expert_up_proj back to the hidden; shared experts
on x. Like DeepSeek's kinds both return this rank's partial output (the block all-reduces): the routed sum is
all-reduced here first (the norm between it and the up projection is not linear), and the replicated up
projection's result is added on tp rank 0 only."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import TextConfig
from engine.layers.linear import LinearSlot, RMSNorm
from engine.models.deepseek_v3.moe import Router, dispatch
from engine.models.kimi_linear.config import KimiConfig, kimi_config
from engine.models.kimi_linear.ops import situ
from kconvert.distributed import Group
from kconvert.errors import EngineError


class KimiMLP(nn.Module):
    """`gate_proj`, `up_proj`, `down_proj`: down(act(gate(x), up(x))), act SiTU or SwiGLU."""

    def __init__(self, cfg: TextConfig | None = None, layer: int | None = None, par: Group | None = None,
                 k: KimiConfig | None = None):
        super().__init__()
        self.k = k or kimi_config(cfg)
        self.gate_proj, self.up_proj, self.down_proj = LinearSlot(), LinearSlot(), LinearSlot()

    def forward(self, x: torch.Tensor, ids=None) -> torch.Tensor:
        return self.down_proj(activate(self.k, self.gate_proj(x), self.up_proj(x)))


def activate(k: KimiConfig, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return situ(up, gate, k.situ_beta, k.situ_linear_beta) if k.activation == "situ" else F.silu(gate) * up


class Expert(nn.Module):
    """A routed expert as released: `w1` (gate), `w3` (up), `w2` (down)."""

    def __init__(self, k: KimiConfig):
        super().__init__()
        self.k = k
        self.w1, self.w2, self.w3 = LinearSlot(), LinearSlot(), LinearSlot()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(activate(self.k, self.w1(x), self.w3(x)))


def route(k: KimiConfig, x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor | None):
    """(expert ids [N,k], weights [N,k]): sigmoid scores in float32, top-k on score + bias, weights from the raw
    scores, renormalised, scaled."""
    scores = F.linear(x.float(), gate_w.float()).sigmoid()
    choice = scores + bias.float() if bias is not None else scores
    ids = choice.topk(k.top_k, dim=-1).indices
    w = scores.gather(1, ids)
    if k.renormalize and k.top_k > 1:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return ids, w * k.routed_scale


class KimiMoE(nn.Module):
    """`gate` (router), `experts.E` (w1 / w2 / w3) for this rank's whole experts, `shared_experts`, and with a latent width
    `routed_expert_down_proj`, `routed_expert_norm`, `routed_expert_up_proj`."""

    def __init__(self, cfg: TextConfig, layer: int, par: Group):
        super().__init__()
        k = self.k = kimi_config(cfg)
        self.par = par
        if k.experts % par.tp:
            raise EngineError(f"{k.experts} routed experts do not split over tp={par.tp}")
        per = k.experts // par.tp
        self.first = par.tp_rank * per
        self.gate = Router()
        self.experts = nn.ModuleDict({str(e): Expert(k) for e in range(self.first, self.first + per)})
        self.shared_experts = KimiMLP(k=k) if k.shared_experts else None
        if k.latent:
            self.routed_expert_down_proj, self.routed_expert_up_proj = LinearSlot(), LinearSlot()
            self.routed_expert_norm = RMSNorm(k.eps) if k.latent_norm else None

    def forward(self, x: torch.Tensor, ids=None) -> torch.Tensor:
        shape, k = x.shape, self.k
        x = x.reshape(-1, shape[-1])
        chosen, w = route(k, x, self.gate.weight, self.gate.e_score_correction_bias)
        z = self.routed_expert_down_proj(x) if k.latent else x
        routed = dispatch(z, chosen, w, self.experts, self.first, k.experts, torch.zeros_like(z))
        out = self.shared_experts(x) if self.shared_experts is not None else torch.zeros_like(x)
        if k.latent:
            routed = self.par.all_reduce(routed)  # the whole routed sum: the norm is not linear in it
            if self.routed_expert_norm is not None:
                routed = self.routed_expert_norm(routed)
            routed = self.routed_expert_up_proj(routed)
            if self.par.tp_rank != 0:  # replicated: counted once by the block's all-reduce
                routed = torch.zeros_like(routed)
        return (routed + out).view(shape)
