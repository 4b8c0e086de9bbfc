"""DeepSeek-V4 MoE (kind "v4_moe"): sqrt(softplus) router scores, experts chosen by top-k on score + bias
(or, on hash layers, by the fixed table `tid2eid[token id]`), weights = the chosen scores renormalised and
scaled by `routed_scaling_factor`; SwiGLU with the gate clamped to <= swiglu_limit and the up projection to
+-swiglu_limit, in the routed and the shared expert alike. Routed experts are placed whole per tp rank
(expert parallel, as engine/models/deepseek_v3/moe.py); the shared expert is column / row split."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import TextConfig
from engine.layers.linear import LinearSlot
from engine.models.deepseek_v3.moe import dispatch
from engine.layers.slots import slot
from engine.models.deepseek_v4.config import V4Config, v4_config
from kconvert.distributed import Group
from kconvert.errors import EngineError

SCORES = {
    "sqrtsoftplus": lambda z: F.softplus(z).sqrt(),
    "sigmoid": torch.sigmoid,
    "softmax": lambda z: z.softmax(-1),
}


class ClampedMLP(nn.Module):
    """`gate_proj`, `up_proj`, `down_proj` with V4's SwiGLU clamp."""

    def __init__(self, limit: float):
        super().__init__()
        self.limit = limit
        self.gate_proj, self.up_proj, self.down_proj = LinearSlot(), LinearSlot(), LinearSlot()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x).clamp(max=self.limit)
        up = self.up_proj(x).clamp(min=-self.limit, max=self.limit)
        return self.down_proj(F.silu(gate) * up)


class V4Router(nn.Module):
    """`weight` [experts, hidden]; `tid2eid` [vocab, top-k] on hash layers, else `e_score_correction_bias`."""

    def __init__(self, c: V4Config, hashed: bool):
        super().__init__()
        if c.scoring not in SCORES:
            raise EngineError(f"the engine has no router scoring {c.scoring!r} (known: {', '.join(SCORES)})")
        self.c, self.hashed = c, hashed
        slot(self, "weight")
        slot(self, "tid2eid" if hashed else "e_score_correction_bias")

    def forward(self, x: torch.Tensor, ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [N,k], weights [N,k]) for tokens x [N,hidden] (token ids [N] on hash layers)."""
        scores = SCORES[self.c.scoring](F.linear(x, self.weight.to(x.dtype)))
        if self.hashed:
            if ids is None:
                raise EngineError("a hash-routed MoE layer needs the token ids")
            chosen = self.tid2eid[ids.reshape(-1).to(self.tid2eid.device)].long()
        else:
            chosen = torch.topk(scores + self.e_score_correction_bias, self.c.top_k, dim=-1).indices
        w = scores.gather(1, chosen)
        return chosen, w / (w.sum(-1, keepdim=True) + 1e-20) * self.c.routed_scale


class V4MoE(nn.Module):
    """`gate` (the router), `experts.E` for this rank's whole experts E, `shared_experts`."""

    def __init__(self, cfg: TextConfig, layer: int, par: Group):
        super().__init__()
        c = v4_config(cfg)
        if c.experts % par.tp:
            raise EngineError(f"{c.experts} routed experts do not split over tp={par.tp}")
        self.gate = V4Router(c, c.hash_layers[layer])
        per = c.experts // par.tp
        self.first, self.n_experts = par.tp_rank * per, c.experts
        self.experts = nn.ModuleDict({str(e): ClampedMLP(c.swiglu_limit) for e in range(self.first, self.first + per)})
        self.shared_experts = ClampedMLP(c.swiglu_limit)

    def forward(self, x: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's partial output (its routed experts + its shared-expert slice); the caller all-reduces."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        chosen, w = self.gate(x, ids)
        return dispatch(x, chosen, w, self.experts, self.first, self.n_experts, self.shared_experts(x)).view(shape)
