"""The MoE kinds calibration (engine/calibrate/layerwise.py) knows, one line each: which experts a calibration token
reaches, asked of the engine's own router (DeepSeek-V3/K2's group-limited sigmoid top-k; DeepSeek-V4's
sqrt(softplus) top-k or, on its first layers, the fixed token -> experts hash table), and what an expert's
down projection sees (V4: from the expert's own forward, which clamps its SwiGLU; V3/K2: its silu(gate) * up
computed in place, for memory; Kimi K3: its SiTU from the expert's own forward). A new MoE kind adds its router call
to ROUTERS and its down input to DOWN_INPUTS (and, where they differ, its experts' input and part names)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.calibrate.memory import TokenRows
from engine.models.deepseek_v3.moe import MoE, route
from engine.models.deepseek_v4.moe import V4MoE
from engine.models.kimi_linear.moe import KimiMoE, route as kimi_route

ROUTERS = {  # MoE class -> (moe, tokens x [N, hidden], their ids [N] or None) -> chosen experts [N, k]
    MoE: lambda moe, x, ids: route(moe.cfg, x, moe.gate.weight, moe.gate.e_score_correction_bias)[0],
    V4MoE: lambda moe, x, ids: moe.gate(x, ids)[0],  # hash layers route by token id
    KimiMoE: lambda moe, x, ids: kimi_route(moe.k, x, moe.gate.weight, moe.gate.e_score_correction_bias)[0],
}
# MoE class -> what its experts receive of the MoE's input (Kimi K3's latent MoE: the down-projected tokens)
EXPERT_INPUTS = {KimiMoE: lambda moe, x: moe.routed_expert_down_proj(x) if moe.k.latent else x}
# MoE class -> (the expert's input projections, its down projection): Kimi's experts keep the released w1 / w3 / w2
EXPERT_PARTS = {KimiMoE: (("w1", "w3"), "w2")}
DEEPSEEK_PARTS = (("gate_proj", "up_proj"), "down_proj")


def routed_moe(layer: nn.Module) -> nn.Module | None:
    """The layer's MoE module (`mlp`, or Kimi's `block_sparse_moe`), if its kind is one ROUTERS knows."""
    mlp = getattr(layer, "mlp", None) or getattr(layer, "block_sparse_moe", None)
    return mlp if type(mlp) in ROUTERS else None


def expert_parts(moe: nn.Module) -> tuple[tuple[str, ...], str]:
    return EXPERT_PARTS.get(type(moe), DEEPSEEK_PARTS)


def keep_input(moe: nn.Module, into: TokenRows) -> torch.utils.hooks.RemovableHandle:
    """A hook adding the MoE's tokens [N, hidden] (and their ids, where given) to `into` each time it runs."""
    def hook(_mod, args):
        ids = args[1] if len(args) > 1 else None
        into.add(args[0], ids)
    return moe.register_forward_pre_hook(hook)


def chosen_experts(moe: nn.Module, kept: TokenRows) -> tuple[torch.Tensor, torch.Tensor]:
    """(what the experts receive of every token the MoE saw [N, width], chosen experts [N, k]), by its router."""
    chosen = ROUTERS[type(moe)](moe, kept.rows, kept.token_ids())
    into_experts = EXPERT_INPUTS.get(type(moe))
    return (kept.rows if into_experts is None else into_experts(moe, kept.rows)), chosen


class _Seen(Exception):
    """Raised by the hook below once down_proj's input is taken: the projection itself is not computed."""


def _down_input_seen(expert: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What `expert.down_proj` receives when the expert runs on x (its activation, clamps and all)."""
    seen = []

    def take(_m, args):
        seen.append(args[0])
        raise _Seen

    h = getattr(expert, "down_proj", None) or expert.w2  # Kimi's experts: w2
    h = h.register_forward_pre_hook(take)
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


DOWN_INPUTS = {MoE: _swiglu_in_place, V4MoE: _down_input_seen,  # MoE class -> (expert, x) -> down_proj's input
               KimiMoE: _down_input_seen}


def down_input(moe: nn.Module, expert: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What the expert's down projection receives for tokens x."""
    return DOWN_INPUTS[type(moe)](expert, x)
