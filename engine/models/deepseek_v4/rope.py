"""DeepSeek-V4's partial interleaved RoPE: adjacent pairs of the trailing `rope_dim` dims of a head rotate,
the leading dims pass through; the layout is kept (the rotated output of attention goes back through the
inverse rotation into `o_a_proj`, so no permutation may be left behind)."""

from __future__ import annotations

import torch

from engine.config import RopeConfig
from engine.layers.rope import inv_freq_and_factor


class V4Rotary:
    """cos / sin at any positions for one rope setting (main or compress)."""

    def __init__(self, rope: RopeConfig, dim: int):
        self.inv_freq, self.factor = inv_freq_and_factor(rope, dim)

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape positions.shape + (dim/2,), in `dtype` (as the reference rounds them)."""
        if self.inv_freq.device != positions.device:  # moved once, not per layer and step
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[..., None].float() * self.inv_freq
        return (freqs.cos() * self.factor).to(dtype), (freqs.sin() * self.factor).to(dtype)


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing 2 * cos.shape[-1] dims of x pairwise (x0, x1), (x2, x3) ... in float32; cos/sin
    broadcast against x[..., tail:2]. Inverse rotation: pass -sin."""
    r = 2 * cos.shape[-1]
    head, tail = x[..., :-r], x[..., -r:].float()
    a, b = tail[..., 0::2], tail[..., 1::2]
    c, s = cos.float(), sin.float()
    rotated = torch.stack([a * c - b * s, b * c + a * s], dim=-1).flatten(-2)
    return torch.cat([head, rotated.to(x.dtype)], dim=-1)
