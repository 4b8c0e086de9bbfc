"""MoonViT vision tower + Kimi projector (Kimi-K2.5), from the published tensor layout.

Published `wqkv` keeps each head's query/key rows in rotary pairs (row 2j, 2j+1), so the 2-D rotary is
applied to adjacent pairs: pair j = 2i turns with the patch column (w) at frequency i, pair 2i+1 with the
patch row (h). Attention runs within each image of a packed batch; 2x2 patches merge into one token."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import VisionConfig
from engine.layers.linear import WeightAndBias
from engine.layers.slots import slot
from engine.layers.rope import rotate_interleaved

ACTS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu, "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x)}


class VisionBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm0, self.wqkv, self.wo, self.norm1 = WeightAndBias(), WeightAndBias(), WeightAndBias(), WeightAndBias()
        self.mlp = nn.Module()
        self.mlp.fc0, self.mlp.fc1 = WeightAndBias(), WeightAndBias()


class VisionTower(nn.Module):
    """MoonViT, stored as `patch_embed.{proj, pos_emb}`, `encoder.blocks.N.*`, `encoder.final_layernorm`."""

    def __init__(self, vc: VisionConfig):
        super().__init__()
        self.vc = vc
        self.patch_embed = nn.Module()
        self.patch_embed.proj = WeightAndBias()
        self.patch_embed.pos_emb = nn.Module()
        slot(self.patch_embed.pos_emb, "weight")
        self.encoder = nn.Module()
        self.encoder.blocks = nn.ModuleList(VisionBlock() for _ in range(vc.num_layers))
        self.encoder.final_layernorm = WeightAndBias()
        self.head_dim = vc.hidden_size // vc.num_heads
        quarter = self.head_dim // 2
        self.inv_freq = 1.0 / (vc.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float32) / quarter))
        self.act = ACTS[vc.hidden_act]

    def _pos_embed(self, h: int, w: int, dtype) -> torch.Tensor:
        grid = self.patch_embed.pos_emb.weight.float().permute(2, 0, 1)[None]  # [1,D,Hg,Wg]
        if (h, w) != tuple(grid.shape[-2:]):
            grid = F.interpolate(grid, size=(h, w), mode="bicubic", align_corners=False)
        return grid[0].flatten(1).t().to(dtype)  # [h*w, D], raster order

    def _angles(self, h: int, w: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.arange(h, device=device).repeat_interleave(w).float()
        cols = torch.arange(w, device=device).repeat(h).float()
        inv = self.inv_freq.to(device)
        ang = torch.stack([cols[:, None] * inv, rows[:, None] * inv], dim=-1).flatten(1)  # [n, hd/2]: w, h, w, h...
        return ang.cos(), ang.sin()

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        """pixels [N,3,p,p] (patches of all images, raster order per image), grids [(h, w)] per image
        -> merged patches [sum of merged tokens, kh*kw, hidden], in the pixels' dtype."""
        pw, pb = self.patch_embed.proj.weight, self.patch_embed.proj.bias
        dt = pw.dtype if pixels.dtype == pw.dtype else pixels.dtype
        D, nh, hd = self.vc.hidden_size, self.vc.num_heads, self.head_dim
        x = F.linear(pixels.to(pw.device, dt).flatten(1), pw.to(dt).flatten(1), pb.to(dt))
        x = x + torch.cat([self._pos_embed(h, w, dt) for h, w in grids])
        rot = [self._angles(h, w, x.device) for h, w in grids]
        cos, sin = torch.cat([r[0] for r in rot]).to(dt)[:, None], torch.cat([r[1] for r in rot]).to(dt)[:, None]
        sizes = [h * w for h, w in grids]
        for b in self.encoder.blocks:
            y = F.layer_norm(x, (D,), b.norm0.weight.to(dt), b.norm0.bias.to(dt), 1e-5)
            qkv = F.linear(y, b.wqkv.weight.to(dt), b.wqkv.bias.to(dt)).view(-1, 3, nh, hd)
            q = rotate_interleaved(qkv[:, 0], cos, sin)
            k = rotate_interleaved(qkv[:, 1], cos, sin)
            v = qkv[:, 2]
            outs = []
            for qi, ki, vi in zip(q.split(sizes), k.split(sizes), v.split(sizes)):
                o = F.scaled_dot_product_attention(qi.transpose(0, 1), ki.transpose(0, 1), vi.transpose(0, 1))
                outs.append(o.transpose(0, 1).reshape(-1, D))
            x = x + F.linear(torch.cat(outs), b.wo.weight.to(dt), b.wo.bias.to(dt))
            y = F.layer_norm(x, (D,), b.norm1.weight.to(dt), b.norm1.bias.to(dt), 1e-5)
            y = F.linear(self.act(F.linear(y, b.mlp.fc0.weight.to(dt), b.mlp.fc0.bias.to(dt))),
                         b.mlp.fc1.weight.to(dt), b.mlp.fc1.bias.to(dt))
            x = x + y
        fin = self.encoder.final_layernorm
        x = F.layer_norm(x, (D,), fin.weight.to(dt), fin.bias.to(dt), 1e-5)
        kh, kw = self.vc.merge_kernel
        merged = []
        for xi, (h, w) in zip(x.split(sizes), grids):
            merged.append(xi.view(h // kh, kh, w // kw, kw, D).permute(0, 2, 1, 3, 4).reshape(-1, kh * kw, D))
        return torch.cat(merged)


class Projector(nn.Module):
    """Kimi's mm_projector: `pre_norm` (LayerNorm) -> `proj.0` (Linear) -> GELU -> `proj.2` (Linear)."""

    def __init__(self, vc: VisionConfig):
        super().__init__()
        self.eps = vc.projector_eps
        self.pre_norm = WeightAndBias()
        self.proj = nn.ModuleDict({"0": WeightAndBias(), "2": WeightAndBias()})

    def forward(self, m: torch.Tensor) -> torch.Tensor:
        """merged patches [n, kh*kw, D] -> [n, text hidden]"""
        dt, D = m.dtype, m.shape[-1]
        n, p0, p2 = self.pre_norm, self.proj["0"], self.proj["2"]
        m = F.layer_norm(m, (D,), n.weight.to(dt), n.bias.to(dt), self.eps).flatten(1)
        m = F.gelu(F.linear(m, p0.weight.to(dt), p0.bias.to(dt)))
        return F.linear(m, p2.weight.to(dt), p2.bias.to(dt))


class ImageEncoder:
    """Image features for the text model: the tower, then the projector (both live on the first stage)."""

    def __init__(self, tower: VisionTower, projector: Projector):
        self.tower, self.projector = tower, projector

    @torch.inference_mode()
    def __call__(self, pixels: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        """pixels [N,3,p,p] (patches of all images, raster order per image), grids [(h, w)] per image
        -> [sum of merged tokens, text hidden]."""
        return self.projector(self.tower(pixels, grids))


def tokens_per_image(vc: VisionConfig, grid_hw: tuple[int, int]) -> int:
    """Text positions an image of `grid_hw` patches takes: one per merged kh x kw patch."""
    kh, kw = vc.merge_kernel
    return (grid_hw[0] // kh) * (grid_hw[1] // kw)
