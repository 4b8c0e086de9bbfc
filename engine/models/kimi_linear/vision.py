"""MoonViT-V2 vision tower + the patchmergerv2 projector (Kimi K3), from the released tensor layout (mlx-vlm 0.7.10's
kimi_k3 reads the same names: tests/families/kimi_k3/test_kimi_k3.py checks the features against it).

Differences from Kimi-K2.5's MoonViT (engine/models/kimi_k25/vision.py): no biases anywhere; RMSNorm (eps 2^-7) instead
of LayerNorm; attention `qkv_hidden_size` wide, not the tower's width; the position grid interpolated bilinearly
(half-pixel centres); the 2-D rotary pairs each head's channels (2j, 2j + 1) and turns pair j with the patch
column (j even) or row (j odd) at frequency j // 2 of head_dim / 4; merged 2 x 2 windows are projected by
`proj.0` -> GELU -> `proj.2` -> `post_norm` (RMSNorm on the text width). Images are single frames (t = 1)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import VisionConfig
from engine.layers.slots import Stored, slot

VISION_NORM_EPS = 2.0 ** -7  # MoonViT-V2's RMSNorms (mlx-vlm's kimi_k3 vision, as released)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


class VisionBlockV2(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm0, self.norm1, self.wqkv, self.wo = Stored(), Stored(), Stored(), Stored()
        self.mlp = nn.Module()
        self.mlp.fc0, self.mlp.fc1 = Stored(), Stored()


class VisionTowerV2(nn.Module):
    """`patch_embed.proj`, `patch_embed.pos_emb`, `encoder.blocks.N.*`, `encoder.final_layernorm`."""

    def __init__(self, vc: VisionConfig):
        super().__init__()
        self.vc = vc
        self.patch_embed = nn.Module()
        self.patch_embed.proj = Stored()
        slot(self.patch_embed.proj, "bias", optional=True)
        self.patch_embed.pos_emb = Stored()
        self.encoder = nn.Module()
        self.encoder.blocks = nn.ModuleList(VisionBlockV2() for _ in range(vc.num_layers))
        self.encoder.final_layernorm = Stored()
        self.qkv = vc.qkv_hidden_size or vc.hidden_size
        self.head_dim = self.qkv // vc.num_heads
        self.inv_freq = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 4, dtype=torch.float32)[: self.head_dim // 4]
                                         / self.head_dim))

    def _pos_embed(self, h: int, w: int, dtype) -> torch.Tensor:
        grid = self.patch_embed.pos_emb.weight.float().permute(2, 0, 1)[None]  # [1, D, Hg, Wg]
        if (h, w) != tuple(grid.shape[-2:]):
            grid = F.interpolate(grid, size=(h, w), mode="bilinear", align_corners=False)
        return grid[0].flatten(1).t().to(dtype)  # [h*w, D], raster order

    def _angles(self, h: int, w: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.arange(h, device=device).repeat_interleave(w).float()
        cols = torch.arange(w, device=device).repeat(h).float()
        inv = self.inv_freq.to(device)
        ang = torch.stack([cols[:, None] * inv, rows[:, None] * inv], dim=-1).flatten(1)  # [n, hd/2]: w, h, w, h ...
        return ang.cos(), ang.sin()

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Pairs (2j, 2j + 1) turned by angle j, in float32; x [n, heads, head_dim]."""
        xf = x.float()
        even, odd = xf[..., 0::2], xf[..., 1::2]
        c, s = cos[:, None], sin[:, None]
        return torch.stack([even * c - odd * s, even * s + odd * c], dim=-1).flatten(-2).to(x.dtype)

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        """pixels [N, 3, p, p] (patches of all images, raster order per image), grids [(h, w)] per image ->
        merged windows [sum of merged tokens, kh*kw, hidden], in the pixels' dtype."""
        pw = self.patch_embed.proj.weight
        dt = pw.dtype if pixels.dtype == pw.dtype else pixels.dtype
        bias = self.patch_embed.proj.bias
        x = F.linear(pixels.to(pw.device, dt).flatten(1), pw.to(dt).flatten(1), None if bias is None else bias.to(dt))
        x = x + torch.cat([self._pos_embed(h, w, dt) for h, w in grids])
        rot = [self._angles(h, w, x.device) for h, w in grids]
        cos, sin = torch.cat([r[0] for r in rot]), torch.cat([r[1] for r in rot])
        sizes, nh, hd = [h * w for h, w in grids], self.vc.num_heads, self.head_dim
        for b in self.encoder.blocks:
            qkv = F.linear(_rms(x, b.norm0.weight, VISION_NORM_EPS), b.wqkv.weight.to(dt)).view(-1, 3, nh, hd)
            q, k, v = self._rotate(qkv[:, 0], cos, sin), self._rotate(qkv[:, 1], cos, sin), qkv[:, 2]
            outs = []
            for qi, ki, vi in zip(q.split(sizes), k.split(sizes), v.split(sizes)):
                o = F.scaled_dot_product_attention(qi.transpose(0, 1), ki.transpose(0, 1), vi.transpose(0, 1))
                outs.append(o.transpose(0, 1).reshape(-1, self.qkv))
            x = x + F.linear(torch.cat(outs), b.wo.weight.to(dt))
            y = F.gelu(F.linear(_rms(x, b.norm1.weight, VISION_NORM_EPS), b.mlp.fc0.weight.to(dt)), approximate="tanh")
            x = x + F.linear(y, b.mlp.fc1.weight.to(dt))
        x = _rms(x, self.encoder.final_layernorm.weight, VISION_NORM_EPS)
        kh, kw = self.vc.merge_kernel
        D = x.shape[-1]
        return torch.cat([xi.view(h // kh, kh, w // kw, kw, D).permute(0, 2, 1, 3, 4).reshape(-1, kh * kw, D)
                          for xi, (h, w) in zip(x.split(sizes), grids)])


class PatchMergerV2(nn.Module):
    """`proj.0` -> GELU -> `proj.2` -> `post_norm` over each flattened kh x kw window."""

    def __init__(self, vc: VisionConfig):
        super().__init__()
        self.eps = vc.projector_eps
        self.proj = nn.ModuleDict({"0": Stored(), "2": Stored()})
        self.post_norm = Stored()

    def forward(self, m: torch.Tensor) -> torch.Tensor:
        dt = m.dtype
        h = F.gelu(F.linear(m.flatten(1), self.proj["0"].weight.to(dt)))
        return _rms(F.linear(h, self.proj["2"].weight.to(dt)), self.post_norm.weight, self.eps)
