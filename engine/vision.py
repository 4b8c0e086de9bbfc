"""MoonViT vision tower + Kimi projector (Kimi-K2.5), from the published tensor layout.

Published `wqkv` keeps each head's query/key rows in rotary pairs (row 2j, 2j+1), so the 2-D rotary is
applied to adjacent pairs: pair j = 2i turns with the patch column (w) at frequency i, pair 2i+1 with the
patch row (h). Attention runs within each image of a packed batch; 2x2 patches merge into one token."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.config import VisionConfig
from engine.rope import rotate_interleaved

ACTS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu, "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x)}


class VisionTower:
    def __init__(self, vc: VisionConfig, t: dict):
        self.vc = vc
        self.patch_w = t.pop("vision_tower.patch_embed.proj.weight")
        self.patch_b = t.pop("vision_tower.patch_embed.proj.bias")
        self.pos = t.pop("vision_tower.patch_embed.pos_emb.weight")
        self.blocks = []
        for i in range(vc.num_layers):
            p = f"vision_tower.encoder.blocks.{i}."
            self.blocks.append({k: t.pop(p + k) for k in (
                "norm0.weight", "norm0.bias", "wqkv.weight", "wqkv.bias", "wo.weight", "wo.bias", "norm1.weight",
                "norm1.bias", "mlp.fc0.weight", "mlp.fc0.bias", "mlp.fc1.weight", "mlp.fc1.bias")})
        self.final = (t.pop("vision_tower.encoder.final_layernorm.weight"), t.pop("vision_tower.encoder.final_layernorm.bias"))
        self.proj = {k: t.pop("mm_projector." + k) for k in (
            "pre_norm.weight", "pre_norm.bias", "proj.0.weight", "proj.0.bias", "proj.2.weight", "proj.2.bias")}
        self.head_dim = vc.hidden_size // vc.num_heads
        quarter = self.head_dim // 2
        self.inv_freq = 1.0 / (vc.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float32) / quarter))
        self.act = ACTS[vc.hidden_act]

    def tokens_per_image(self, grid_hw: tuple[int, int]) -> int:
        kh, kw = self.vc.merge_kernel
        return (grid_hw[0] // kh) * (grid_hw[1] // kw)

    def _pos_embed(self, h: int, w: int, dtype) -> torch.Tensor:
        grid = self.pos.float().permute(2, 0, 1)[None]  # [1,D,Hg,Wg]
        if (h, w) != tuple(grid.shape[-2:]):
            grid = F.interpolate(grid, size=(h, w), mode="bicubic", align_corners=False)
        return grid[0].flatten(1).t().to(dtype)  # [h*w, D], raster order

    def _angles(self, h: int, w: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.arange(h, device=device).repeat_interleave(w).float()
        cols = torch.arange(w, device=device).repeat(h).float()
        inv = self.inv_freq.to(device)
        ang = torch.stack([cols[:, None] * inv, rows[:, None] * inv], dim=-1).flatten(1)  # [n, hd/2]: w, h, w, h...
        return ang.cos(), ang.sin()

    @torch.inference_mode()
    def __call__(self, pixels: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        """pixels [N,3,p,p] (patches of all images, raster order per image), grids [(h, w)] per image
        -> [sum of merged tokens, text hidden]."""
        dt = self.patch_w.dtype if pixels.dtype == self.patch_w.dtype else pixels.dtype
        D, nh, hd = self.vc.hidden_size, self.vc.num_heads, self.head_dim
        x = F.linear(pixels.to(self.patch_w.device, dt).flatten(1), self.patch_w.to(dt).flatten(1), self.patch_b.to(dt))
        x = x + torch.cat([self._pos_embed(h, w, dt) for h, w in grids])
        rot = [self._angles(h, w, x.device) for h, w in grids]
        cos, sin = torch.cat([r[0] for r in rot]).to(dt)[:, None], torch.cat([r[1] for r in rot]).to(dt)[:, None]
        sizes = [h * w for h, w in grids]
        for b in self.blocks:
            y = F.layer_norm(x, (D,), b["norm0.weight"].to(dt), b["norm0.bias"].to(dt), 1e-5)
            qkv = F.linear(y, b["wqkv.weight"].to(dt), b["wqkv.bias"].to(dt)).view(-1, 3, nh, hd)
            q = rotate_interleaved(qkv[:, 0], cos, sin)
            k = rotate_interleaved(qkv[:, 1], cos, sin)
            v = qkv[:, 2]
            outs = []
            for qi, ki, vi in zip(q.split(sizes), k.split(sizes), v.split(sizes)):
                o = F.scaled_dot_product_attention(qi.transpose(0, 1), ki.transpose(0, 1), vi.transpose(0, 1))
                outs.append(o.transpose(0, 1).reshape(-1, D))
            x = x + F.linear(torch.cat(outs), b["wo.weight"].to(dt), b["wo.bias"].to(dt))
            y = F.layer_norm(x, (D,), b["norm1.weight"].to(dt), b["norm1.bias"].to(dt), 1e-5)
            y = F.linear(self.act(F.linear(y, b["mlp.fc0.weight"].to(dt), b["mlp.fc0.bias"].to(dt))),
                         b["mlp.fc1.weight"].to(dt), b["mlp.fc1.bias"].to(dt))
            x = x + y
        x = F.layer_norm(x, (D,), self.final[0].to(dt), self.final[1].to(dt), 1e-5)
        kh, kw = self.vc.merge_kernel
        merged = []
        for xi, (h, w) in zip(x.split(sizes), grids):
            merged.append(xi.view(h // kh, kh, w // kw, kw, D).permute(0, 2, 1, 3, 4).reshape(-1, kh * kw, D))
        m = torch.cat(merged)
        p = {k: v.to(dt) for k, v in self.proj.items()}
        m = F.layer_norm(m, (D,), p["pre_norm.weight"], p["pre_norm.bias"], self.vc.projector_eps).flatten(1)
        m = F.gelu(F.linear(m, p["proj.0.weight"], p["proj.0.bias"]))
        return F.linear(m, p["proj.2.weight"], p["proj.2.bias"])
