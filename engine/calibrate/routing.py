"""The MoE kinds calibration (engine/calibrate/layerwise.py) knows, one line each: which experts a calibration token
reaches, asked of the engine's own router (DeepSeek-V3/K2's group-limited sigmoid top-k; DeepSeek-V4's
sqrt(softplus) top-k or, on its first layers, the fixed token -> experts hash table), and what an expert's
down projection sees (V4: from the expert's own forward, which clamps its SwiGLU; V3/K2: its silu(gate) * up
computed in place, for memory). A new MoE kind adds its router call to ROUTERS and its down input to DOWN_INPUTS."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.calibrate.memory import TokenRows
from engine.models.deepseek_v3.moe import MoE, route
from engine.models.deepseek_v4.moe import V4MoE

ROUTERS = {  # MoE class -> (moe, tokens x [N, hidden], their ids [N] or None) -> chosen experts [N, k]
    MoE: lambda moe, x, ids: route(moe.cfg, x, moe.gate.weight, moe.gate.e_score_correction_bias)[0],
    V4MoE: lambda moe, x, ids: moe.gate(x, ids)[0],  # hash layers route by token id
}


def routed_moe(layer: nn.Module) -> nn.Module | None:
    """The layer's MoE module, if its kind is one ROUTERS knows."""
    mlp = getattr(layer, "mlp", None)
    return mlp if type(mlp) in ROUTERS else None


def keep_input(moe: nn.Module, into: TokenRows) -> torch.utils.hooks.RemovableHandle:
    """A hook adding the MoE's tokens [N, hidden] (and their ids, where given) to `into` each time it runs."""
    def hook(_mod, args):
        ids = args[1] if len(args) > 1 else None
        into.add(args[0], ids)
    return moe.register_forward_pre_hook(hook)


def chosen_experts(moe: nn.Module, kept: TokenRows) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens x [N, hidden], chosen experts [N, k]) of every token the MoE saw, by its router."""
    return kept.rows, ROUTERS[type(moe)](moe, kept.rows, kept.token_ids())


class _Seen(Exception):
    """Raised by the hook below once down_proj's input is taken: the projection itself is not computed."""


def _down_input_seen(expert: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What `expert.down_proj` receives when the expert runs on x (its activation, clamps and all)."""
    seen = []

    def take(_m, args):
        seen.append(args[0])
        raise _Seen

    h = expert.down_proj.register_forward_pre_hook(take)
    try:
        expert(x)
    except _Seen:
        pass
    finally:
        h.remove()
    return seen[0]


def _swiglu_in_place(expert: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3/K2's expert activation, silu(gate) * up, in place: an expert can take every calibration
    token, and five such [tokens, moe_inter] tensors at once were the calibrated run's peak (calibrate_memory)."""
    return F.silu(expert.gate_proj(x), inplace=True).mul_(expert.up_proj(x))


DOWN_INPUTS = {MoE: _swiglu_in_place, V4MoE: _down_input_seen}  # MoE class -> (expert, x) -> down_proj's input


def down_input(moe: nn.Module, expert: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What the expert's down projection receives for tokens x."""
    return DOWN_INPUTS[type(moe)](expert, x)
