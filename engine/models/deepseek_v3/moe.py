"""Feed-forward blocks: dense SwiGLU MLP (column/row split) and the DeepSeek MoE (sigmoid router with
e_score_correction_bias, group-limited top-k, shared experts, routed experts placed whole per rank)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import TextConfig
from engine.layers.linear import LinearSlot
from engine.layers.slots import slot
from kconvert.distributed import Group
from kconvert.errors import EngineError


class MLP(nn.Module):
    """SwiGLU: `gate_proj`, `up_proj`, `down_proj` (a dense layer's MLP, a routed or the shared expert)."""

    def __init__(self, cfg: TextConfig | None = None, layer: int | None = None, par: Group | None = None):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = LinearSlot(), LinearSlot(), LinearSlot()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """`weight` [experts, hidden] and, where the checkpoint has it, `e_score_correction_bias` [experts]."""

    def __init__(self):
        super().__init__()
        slot(self, "weight")
        slot(self, "e_score_correction_bias", optional=True)


def route(cfg: TextConfig, x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor | None):
    """(expert ids [N,k], weights [N,k]) per token: sigmoid scores, group-limited choice with the bias,
    weights from the unbiased scores, normalised and scaled."""
    scores = F.linear(x.float(), gate_w.float()).sigmoid()
    choice = scores + bias.float() if bias is not None else scores
    E, G = cfg.n_routed_experts, cfg.n_group
    if G > 1:
        per = choice.view(-1, G, E // G)
        group_score = per.topk(min(2, E // G), dim=-1).values.sum(-1) if bias is not None else per.amax(-1)
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(cfg.topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(E // G, dim=1), float("-inf"))
    ids = choice.topk(cfg.experts_per_token, dim=-1).indices
    w = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return ids, w * cfg.routed_scaling_factor


class MoE(nn.Module):
    """`gate` (the router), `experts.E` for this rank's whole experts E (expert parallel) and `shared_experts`."""

    def __init__(self, cfg: TextConfig, layer: int, par: Group):
        super().__init__()
        self.cfg = cfg
        self.gate = Router()
        if cfg.n_routed_experts % par.tp:
            raise EngineError(f"{cfg.n_routed_experts} routed experts do not split over tp={par.tp}")
        per = cfg.n_routed_experts // par.tp
        self.first = par.tp_rank * per
        self.experts = nn.ModuleDict({str(e): MLP() for e in range(self.first, self.first + per)})
        self.shared_experts = MLP() if cfg.n_shared_experts else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial output (local routed experts + its shared-expert slice); caller all-reduces."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        ids, w = route(self.cfg, x, self.gate.weight, self.gate.e_score_correction_bias)
        out = self.shared_experts(x) if self.shared_experts is not None else torch.zeros_like(x)
        return dispatch(x, ids, w, self.experts, self.first, self.cfg.n_routed_experts, out).view(shape)


def dispatch(x: torch.Tensor, chosen: torch.Tensor, w: torch.Tensor, experts: nn.ModuleDict, first: int,
             n_experts: int, out: torch.Tensor) -> torch.Tensor:
    """Add this rank's routed experts' weighted outputs to `out` (tokens x [N, hidden]; chosen, w [N, k]):
    experts `first`.. in `experts`, each run once on all the tokens routed to it. Every MoE kind dispatches
    here (DeepSeek-V3/K2's and V4's differ in their routers and expert activations only)."""
    k = chosen.shape[1]
    flat = chosen.flatten()
    order = flat.argsort(stable=True)  # assignments grouped by expert
    counts = torch.bincount(flat, minlength=n_experts).tolist()
    wflat = w.flatten().to(x.dtype)
    offset = sum(counts[:first])
    for e in range(first, first + len(experts)):
        n = counts[e]
        if n:
            rows = order[offset:offset + n]
            tokens = rows // k
            out.index_add_(0, tokens, experts[str(e)](x[tokens]) * wflat[rows, None])
            offset += n
    return out
