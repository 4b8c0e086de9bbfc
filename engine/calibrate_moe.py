"""The MoE kinds calibration (engine/calibrate.py) knows, one line each: which experts a calibration token
reaches, asked of the engine's own router (DeepSeek-V3/K2's group-limited sigmoid top-k; DeepSeek-V4's
sqrt(softplus) top-k or, on its first layers, the fixed token -> experts hash table), and what an expert's
down projection sees, from the expert's own forward (V4 clamps its SwiGLU: no formula is repeated here).
A new MoE kind adds its router call to ROUTERS."""

from __future__ import annotations

import torch
from torch import nn

from engine.moe import MoE, route
from engine.v4_moe import V4MoE

ROUTERS = {  # MoE class -> (moe, tokens x [N, hidden], their ids [N] or None) -> chosen experts [N, k]
    MoE: lambda moe, x, ids: route(moe.cfg, x, moe.gate.weight, moe.gate.e_score_correction_bias)[0],
    V4MoE: lambda moe, x, ids: moe.gate(x, ids)[0],  # hash layers route by token id
}


def routed_moe(layer: nn.Module) -> nn.Module | None:
    """The layer's MoE module, if its kind is one ROUTERS knows."""
    mlp = getattr(layer, "mlp", None)
    return mlp if type(mlp) in ROUTERS else None


def keep_input(moe: nn.Module, into: list) -> torch.utils.hooks.RemovableHandle:
    """A hook appending (tokens [N, hidden], their ids [N] or None) to `into` each time the MoE runs."""
    def hook(_mod, args):
        x = args[0].reshape(-1, args[0].shape[-1])
        ids = args[1] if len(args) > 1 and args[1] is not None else None
        into.append((x, ids.reshape(-1) if ids is not None else None))
    return moe.register_forward_pre_hook(hook)


def chosen_experts(moe: nn.Module, kept: list) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens x [N, hidden], chosen experts [N, k]) of every token the MoE saw, by its router."""
    x = torch.cat([t for t, _ in kept])
    ids = torch.cat([i for _, i in kept]) if all(i is not None for _, i in kept) else None
    return x, ROUTERS[type(moe)](moe, x, ids)


def down_input(expert: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What `expert.down_proj` receives when the expert runs on x (its activation, clamps and all)."""
    seen = []
    h = expert.down_proj.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    try:
        expert(x)
    finally:
        h.remove()
    return seen[0]
