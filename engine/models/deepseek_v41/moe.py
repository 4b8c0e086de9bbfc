"""DeepSeek-V4.1's MoE (stored as `layers.N.ffn.*`): sqrt(softplus) router scores in float32, experts chosen by
top-k on score + bias, where image tokens take `bias_vl` instead of `bias`; weights = the chosen scores
renormalised (norm_topk_prob) and scaled by routed_scaling_factor; V4's clamped SwiGLU (`w1` gate, `w3` up, `w2`
down) in the routed and the shared expert, where a `swiglu_limit` of 0 (or below) means no clamp, as both MLX
references read it (mlx-vlm's and mlx-lm's deepseek_v41 clamp only when the limit is positive). Routed experts whole per tp rank (engine/models/deepseek_v3/moe.py
dispatch); the shared expert column / row split."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.linear import LinearSlot
from engine.layers.slots import slot
from engine.models.deepseek_v3.moe import dispatch
from engine.models.deepseek_v4.moe import SCORES
from engine.models.deepseek_v41.config import V41Config
from kconvert.distributed import Group
from kconvert.errors import EngineError


class ClampedSwiGLU(nn.Module):
    def __init__(self, limit: float):
        super().__init__()
        self.limit = limit
        self.w1, self.w2, self.w3 = LinearSlot(), LinearSlot(), LinearSlot()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x), self.w3(x)
        if self.limit > 0:  # 0: unclamped (clamping at 0 would zero every gate's positive half)
            gate, up = gate.clamp(max=self.limit), up.clamp(min=-self.limit, max=self.limit)
        return self.w2(F.silu(gate) * up)


class V41Router(nn.Module):
    """`weight` [experts, hidden], `bias` and `bias_vl` [experts]."""

    def __init__(self, c: V41Config):
        super().__init__()
        if c.scoring not in SCORES:
            raise EngineError(f"the engine has no router scoring {c.scoring!r} (known: {', '.join(SCORES)})")
        self.c = c
        for name in ("weight", "bias", "bias_vl"):
            slot(self, name)

    def forward(self, x: torch.Tensor, image: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        scores = SCORES[self.c.scoring](F.linear(x.float(), self.weight.float()))
        bias = self.bias.float() if image is None else \
            torch.where(image.reshape(-1, 1), self.bias_vl.float(), self.bias.float())
        chosen = torch.topk(scores + bias, self.c.top_k, dim=-1).indices
        w = scores.gather(1, chosen)
        if self.c.norm_topk and self.c.top_k > 1:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return chosen, w * self.c.routed_scale


class V41MoE(nn.Module):
    """`gate`, `experts.E` for this rank's whole experts E, `shared_experts`."""

    def __init__(self, c: V41Config, par: Group):
        super().__init__()
        if c.experts % par.tp:
            raise EngineError(f"{c.experts} routed experts do not split over tp={par.tp}")
        self.gate = V41Router(c)
        per = c.experts // par.tp
        self.first, self.n_experts = par.tp_rank * per, c.experts
        self.experts = nn.ModuleDict({str(e): ClampedSwiGLU(c.swiglu_limit) for e in range(self.first, self.first + per)})
        self.shared_experts = ClampedSwiGLU(c.swiglu_limit)

    def forward(self, x: torch.Tensor, image: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's partial output; `image` [B, S] marks image tokens (their router bias is `bias_vl`)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        chosen, w = self.gate(x, image)
        return dispatch(x, chosen, w, self.experts, self.first, self.n_experts, self.shared_experts(x)).view(shape)
