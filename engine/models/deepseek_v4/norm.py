"""DeepSeek-V4's RMS norms: the weighted one scales in float32 and rounds once (its weights are float32
in the release), the weightless one (per-head queries, mHC inputs) rounds the factor to the input dtype."""

from __future__ import annotations

import torch

from engine.layers.linear import RMSNorm


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class V4RMSNorm(RMSNorm):
    """`weight` [dim], scaled in float32 and rounded once (RMSNorm scales in the input's dtype)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)
