"""DeepSeek-V4.1's vision tower, aligner and image span, from the released tensor layout (mlx-vlm 0.7.10's
deepseek_v41 reads the same names: tests/families/dsv41/test_dsv41_vision.py checks the spans against it).

Tower (`vision.*`, the engine's `vision_tower.vision.*`): each patch's 3 x p x p values, flattened channel by
channel, through a Linear with bias; blocks of RMSNorm -> fused qkv attention (biases) with a 2-D rotary ->
RMSNorm -> SwiGLU (`w1` makes the gate, then the up half); a final RMSNorm. The attention is full and
bidirectional, one image at a time. The rotary turns channel i of each head with channel i + head_dim / 2
("rotate half"); the first head_dim / 4 of those pairs turn with the patch row, the rest with the patch column,
at frequencies theta^(-4j / head_dim).

Aligner (`aligner.*`, the engine's `mm_projector.aligner.*`): each r x r window of the patch grid (a partial
window at the bottom or right filled with zeros) becomes one vector, channel-major (all r * r neighbours of a
channel, in reading order, before the next channel), then Linear -> exact GELU -> Linear to the text width.

Span: an image takes `image_start`, then per row of windows its aligner rows and `image_newline`, then
`image_end`: rows x (cols + 1) + 2 text positions, every one carrying the image token (the text model treats
the whole span as image tokens)."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import VisionConfig
from engine.layers.linear import WeightAndBias
from engine.layers.slots import Stored, slot

VISION_NORM_EPS = 1e-6  # the tower's RMSNorms (mlx-vlm's deepseek_v4 / v41 vision)


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + VISION_NORM_EPS) * w.float()).to(x.dtype)


def _linear(x: torch.Tensor, m: nn.Module) -> torch.Tensor:
    bias = getattr(m, "bias", None)
    return F.linear(x, m.weight.to(x.dtype), None if bias is None else bias.to(x.dtype))


def llm_grid(grid_hw: tuple[int, int], r: int) -> tuple[int, int]:
    """Rows and columns of aligner windows over a patch grid: a partial window counts."""
    return math.ceil(grid_hw[0] / r), math.ceil(grid_hw[1] / r)


def span_length(vc: VisionConfig, grid_hw: tuple[int, int]) -> int:
    """Text positions one image of `grid_hw` patches takes: start, rows x (cols + newline), end."""
    rows, cols = llm_grid(grid_hw, vc.merge_kernel[0])
    return rows * (cols + 1) + 2


class ViTFeatures(NamedTuple):
    """The tower's output per image ([h * w, hidden] in reading order) with its patch grid, for the aligner."""

    features: list[torch.Tensor]
    grids: list[tuple[int, int]]


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = Stored(), Stored()
        self.attn = nn.Module()
        self.attn.wqkv, self.attn.wo = WeightAndBias(), WeightAndBias()
        self.mlp = nn.Module()
        self.mlp.w1, self.mlp.w2 = Stored(), Stored()


class _ViT(nn.Module):
    def __init__(self, vc: VisionConfig):
        super().__init__()
        self.patch_embed = nn.Module()
        self.patch_embed.proj = WeightAndBias()
        self.blocks = nn.ModuleList(_Block() for _ in range(vc.num_layers))
        self.norm = Stored()


class DeepseekViT(nn.Module):
    """`vision.patch_embed.proj`, `vision.blocks.N.*`, `vision.norm` (under the engine's `vision_tower.`)."""

    def __init__(self, vc: VisionConfig):
        super().__init__()
        self.vc = vc
        self.vision = _ViT(vc)
        self.head_dim = vc.hidden_size // vc.num_heads
        quarter = self.head_dim // 4
        self.inv_freq = 1.0 / vc.rope_theta ** (torch.arange(quarter, dtype=torch.float32) * 4 / self.head_dim)

    def _angles(self, h: int, w: int, device) -> torch.Tensor:
        """[h * w, head_dim / 2]: the patch row's angles, then the column's."""
        rows = torch.arange(h, dtype=torch.float32, device=device).repeat_interleave(w)
        cols = torch.arange(w, dtype=torch.float32, device=device).repeat(h)
        inv = self.inv_freq.to(device)
        return torch.cat([rows[:, None] * inv, cols[:, None] * inv], dim=-1)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Channel i with i + head_dim / 2, in float32; x [n, heads, head_dim], cos / sin [n, head_dim / 2]."""
        a, b = x.float().chunk(2, dim=-1)
        c, s = cos[:, None], sin[:, None]
        return torch.cat([a * c - b * s, b * c + a * s], dim=-1).to(x.dtype)

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int]]) -> ViTFeatures:
        """pixels [N, 3, p, p] (patches of all images, reading order per image), grids [(h, w)] per image."""
        v = self.vision
        pw = v.patch_embed.proj.weight
        dt = pixels.dtype
        x = _linear(pixels.to(pw.device).flatten(1), v.patch_embed.proj)
        angles = torch.cat([self._angles(h, w, x.device) for h, w in grids])
        cos, sin = angles.cos(), angles.sin()
        sizes, nh, hd = [h * w for h, w in grids], self.vc.num_heads, self.head_dim
        for b in v.blocks:
            qkv = _linear(_rms(x, b.norm1.weight), b.attn.wqkv).view(-1, 3, nh, hd)
            q, k, val = self._rotate(qkv[:, 0], cos, sin), self._rotate(qkv[:, 1], cos, sin), qkv[:, 2]
            outs = [F.scaled_dot_product_attention(qi.transpose(0, 1), ki.transpose(0, 1), vi.transpose(0, 1))
                    .transpose(0, 1).reshape(-1, nh * hd)
                    for qi, ki, vi in zip(q.split(sizes), k.split(sizes), val.split(sizes))]
            x = x + _linear(torch.cat(outs), b.attn.wo)
            gate, up = _linear(_rms(x, b.norm2.weight), b.mlp.w1).chunk(2, dim=-1)
            x = x + _linear(F.silu(gate) * up, b.mlp.w2)
        x = _rms(x, v.norm.weight).to(dt)
        return ViTFeatures(list(x.split(sizes)), list(grids))


class DeepseekAligner(nn.Module):
    """`aligner.w1` -> GELU -> `aligner.w2` over each r x r window, and the span's learned `image_start`,
    `image_newline`, `image_end` (under the engine's `mm_projector.`)."""

    def __init__(self, vc: VisionConfig):
        super().__init__()
        self.r = vc.merge_kernel[0]
        self.aligner = nn.Module()
        self.aligner.w1, self.aligner.w2 = WeightAndBias(), WeightAndBias()
        for name in ("image_start", "image_end", "image_newline"):
            slot(self, name)

    def windows(self, x: torch.Tensor, grid_hw: tuple[int, int]) -> torch.Tensor:
        """[h * w, D] -> [rows * cols, D * r * r]: each window channel-major, a partial one zero-filled."""
        (h, w), r, D = grid_hw, self.r, x.shape[-1]
        rows, cols = llm_grid(grid_hw, r)
        g = F.pad(x.view(h, w, D), (0, 0, 0, cols * r - w, 0, rows * r - h))
        return g.view(rows, r, cols, r, D).permute(0, 2, 4, 1, 3).reshape(rows * cols, D * r * r)

    def span(self, x: torch.Tensor, grid_hw: tuple[int, int]) -> torch.Tensor:
        """One image's span rows [rows * (cols + 1) + 2, text hidden] from its tower features [h * w, D]."""
        rows, cols = llm_grid(grid_hw, self.r)
        a = self.aligner
        y = _linear(F.gelu(_linear(self.windows(x, grid_hw), a.w1)), a.w2)
        dt, H = y.dtype, y.shape[-1]
        newline = self.image_newline.to(y.device, dt).expand(rows, 1, H)
        body = torch.cat([y.view(rows, cols, H), newline], dim=1).reshape(-1, H)
        return torch.cat([self.image_start.to(y.device, dt)[None], body, self.image_end.to(y.device, dt)[None]])

    def forward(self, feats: ViTFeatures) -> torch.Tensor:
        """Every image's span, in order: [sum of span lengths, text hidden]."""
        return torch.cat([self.span(x, g) for x, g in zip(feats.features, feats.grids)])
