"""Rotary position embeddings: YaRN frequencies, interleaved (MLA) and half-split (indexer) rotation."""

from __future__ import annotations

import math

import torch

from engine.config import RopeConfig


def _mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def inv_freq_and_factor(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies for a `dim`-wide rotary slice and the cos/sin scale (YaRN's attention factor)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    base_freq = rope.theta ** exponents
    if rope.kind == "default":
        return 1.0 / base_freq, 1.0
    f = rope.factor
    if rope.attention_factor is not None:
        att = float(rope.attention_factor)
    elif rope.mscale and rope.mscale_all_dim:
        att = _mscale(f, rope.mscale) / _mscale(f, rope.mscale_all_dim)
    else:
        att = _mscale(f)

    def corr_dim(rotations: float) -> float:
        return dim * math.log(rope.original_max / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = corr_dim(rope.beta_fast), corr_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1: keep the original frequency, 0: interpolate by the factor
    inv = (1.0 / (f * base_freq)) * (1 - extrapolate) + (1.0 / base_freq) * extrapolate
    return inv, att


def softmax_scale(rope: RopeConfig, head_dim: int) -> float:
    """Attention softmax scale: head_dim^-0.5, times YaRN's mscale(all_dim)^2 (DeepSeek)."""
    scale = head_dim ** -0.5
    if rope.kind == "yarn" and rope.mscale_all_dim:
        m = _mscale(rope.factor, rope.mscale_all_dim)
        scale *= m * m
    return scale


class Rotary:
    """cos/sin per position for one rotary width, grown on demand (no per-step recomputation)."""

    def __init__(self, rope: RopeConfig, dim: int, device="cpu"):
        self.inv_freq, self.factor = inv_freq_and_factor(rope, dim)
        self.inv_freq = self.inv_freq.to(device)
        self.cos = self.sin = torch.empty(0, dim // 2, device=device)

    def _grow(self, n: int) -> None:
        n = max(n, 2 * self.cos.shape[0], 256)
        t = torch.arange(n, dtype=torch.float32, device=self.inv_freq.device)
        freqs = torch.outer(t, self.inv_freq)
        self.cos, self.sin = freqs.cos() * self.factor, freqs.sin() * self.factor

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape positions.shape + (dim/2,)."""
        need = int(positions.max()) + 1
        if need > self.cos.shape[0]:
            self._grow(need)
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs (x0, x1), (x2, x3), ...; the result is laid out [rotated evens | rotated odds]
    (a fixed permutation of the pairs' dims, applied to queries and keys alike, so dot products are those of
    the interleaved rotation). cos/sin broadcast against x[..., ::2]."""
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Non-interleaved rotation: dim i pairs with dim i + d/2."""
    h = x.shape[-1] // 2
    a, b = x[..., :h], x[..., h:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
