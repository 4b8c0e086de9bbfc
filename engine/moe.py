"""Feed-forward blocks: dense SwiGLU MLP (column/row split) and the DeepSeek MoE (sigmoid router with
e_score_correction_bias, group-limited top-k, shared experts, routed experts placed whole per rank)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.config import TextConfig
from engine.linear import Weight
from kconvert.errors import EngineError


class MLP:
    def __init__(self, t: dict, p: str):
        self.gate, self.up, self.down = (Weight.take(t, f"{p}{n}") for n in ("gate_proj", "up_proj", "down_proj"))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


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


class MoE:
    def __init__(self, cfg: TextConfig, t: dict, p: str, rank: int, tp: int):
        self.cfg = cfg
        self.gate_w = t.pop(f"{p}gate.weight")
        self.bias = t.pop(f"{p}gate.e_score_correction_bias", None)
        per = cfg.n_routed_experts // tp
        self.first = rank * per
        self.experts = {e: MLP(t, f"{p}experts.{e}.") for e in range(self.first, self.first + per)
                        if f"{p}experts.{e}.gate_proj.weight" in t or f"{p}experts.{e}.gate_proj.weight_packed" in t}
        if len(self.experts) != per:
            raise EngineError(f"rank {rank} holds {len(self.experts)} experts, expected {per} (experts {self.first}..)")
        self.shared = MLP(t, f"{p}shared_experts.") if cfg.n_shared_experts else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial output (local routed experts + its shared-expert slice); caller all-reduces."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        ids, w = route(self.cfg, x, self.gate_w, self.bias)
        out = self.shared(x) if self.shared is not None else torch.zeros_like(x)
        k = ids.shape[1]
        flat = ids.flatten()
        order = flat.argsort(stable=True)  # assignments grouped by expert
        counts = torch.bincount(flat, minlength=self.cfg.n_routed_experts).tolist()
        wflat = w.flatten().to(x.dtype)
        offset = sum(counts[: self.first])
        for e in range(self.first, self.first + len(self.experts)):
            n = counts[e]
            if n:
                rows = order[offset:offset + n]
                tokens = rows // k
                y = self.experts[e](x[tokens]) * wflat[rows, None]
                out.index_add_(0, tokens, y)
                offset += n
        return out.view(shape)
