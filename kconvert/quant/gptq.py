"""GPTQ for group-wise INT4 and for NVFP4: codes chosen column by column with the rounding error of each column fed back
into the columns not yet quantized, weighted by the inverse Hessian of the layer's inputs (H = sum x x^T
over the calibration tokens the linear saw). The result minimises ||X W^T - X Q^T|| far better than
rounding each weight to its nearest code.

Static activation order (what compressed-tensors reads without a `g_idx`): the group scales are fixed
first, from the original weight's contiguous groups, by the grid's own rule; then the columns are visited
in order of decreasing Hessian diagonal (the inputs that matter most first), each quantized with the scale
of its own group. The stored layout is the plain group layout: any reader of `q * scale[group]` reads it.

Grids (the codes a scale multiplies; `Grid.nearest` rounds one column, the one step GPTQ asks of a grid):
- `kconvert`: shard's int4, codes -8..7, scale amax / 7 with the clipping search (`int4_scales`);
- `minmax`: compressed-tensors' rule, codes -8..7, scale bf16(amax / 7.5);
- `kimi`: Kimi-K2-Thinking's 15 levels, codes -7..7, scale bf16(amax / 7);
- `nvfp4`: e2m1 values +-{0, 0.5, 1, 1.5, 2, 3, 4, 6} (not uniform), each 16-block's scale e4m3 times the tensor's
  float32 weight_scale_2, both fixed first exactly as the uncalibrated nvfp4 path fixes them (ModelOpt's amax rule:
  quant/nvfp4.py, a fused w1 / w3 pair's shared weight_scale_2); each value the nearest e2m1 of w / (block scale *
  weight_scale_2), that product in float32 as the format dequantizes it. With no correlation between inputs
  (H = identity) no error flows between columns and the codes are round-to-nearest's, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kconvert.quant.int4_group import INT4_HALF_RANGE, int4_group_codes

DAMP = 0.01  # fraction of the mean Hessian diagonal added to it (GPTQ's percdamp)
BLOCK = 128  # columns whose error is fed back lazily, as one matrix product
MAX_DAMP_TRIES = 6  # damping grows 10x per failed Cholesky; then the identity (rounding to nearest)


@dataclass(frozen=True)
class Grid:
    name: str
    half_range: float  # scale = amax / half_range
    qmin: int
    qmax: int
    scale_dtype: torch.dtype
    search: bool  # the clipping search of shard's int4 (else plain amax)
    scheme = "int4"  # the quantization scheme whose codes it makes
    code_dtype = torch.int8

    def nearest(self, x: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(code, the value it stands for) of each x at its scale s: the nearest integer code, clamped."""
        q = torch.clamp(torch.round(x / s), self.qmin, self.qmax)
        return q, q * s

    def gptq(self, w: torch.Tensor, H: torch.Tensor | None, *, group: int, search: str = "mse",
             scale_2: float | None = None, name: str = "") -> tuple[torch.Tensor, ...]:
        """(int8 codes, group scales) of w: gptq_quantize."""
        return gptq_quantize(w, H, group, self, search=search, name=name)

    def dequantize(self, parts: tuple[torch.Tensor, ...], group: int) -> torch.Tensor:
        codes, scale = parts
        return codes.to(torch.float32) * scale.to(torch.float32).repeat_interleave(group, dim=1)


@dataclass(frozen=True)
class Nvfp4Grid:
    """NVFP4's e2m1 values at the fixed scales of the uncalibrated path (quant/nvfp4.py)."""

    name: str = "nvfp4"
    scheme = "nvfp4"
    code_dtype = torch.uint8  # sign bit 3, magnitude index bits 0-2 (the stored nibble)

    def nearest(self, x: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from kconvert.quant.nvfp4 import e2m1_value, signed_codes

        c = signed_codes(x / s)
        return c, e2m1_value(c) * s

    def gptq(self, w: torch.Tensor, H: torch.Tensor | None, *, group: int = 0, search: str = "",
             scale_2: float | None = None, name: str = "") -> tuple[torch.Tensor, ...]:
        """(uint8 codes [R, C], e4m3 block scales [R, C/16], float32 weight_scale_2 [1]) of w: the uncalibrated
        path's scales (`scale_2` a fused group's shared one, else w's own), then GPTQ codes (nearest where H is
        None)."""
        from kconvert.quant.nvfp4 import GROUP, nvfp4_scales

        block_scale, s2 = nvfp4_scales(w, scale_2, name)
        per_block = block_scale.to(torch.float32) * s2  # what the format dequantizes with, and divides by
        if H is None:
            codes = self.nearest(w.to(torch.float32), per_block.repeat_interleave(GROUP, dim=1))[0]
        else:
            codes = gptq_codes(w, H, per_block, GROUP, self)
        return codes, block_scale, s2.reshape(1)

    def dequantize(self, parts: tuple[torch.Tensor, ...], group: int = 0) -> torch.Tensor:
        from kconvert.quant.nvfp4 import GROUP, e2m1_value

        codes, block_scale, s2 = parts
        per_block = block_scale.to(torch.float32) * s2.to(torch.float32).reshape(())
        return e2m1_value(codes) * per_block.repeat_interleave(GROUP, dim=1)


GRIDS = {g.name: g for g in (  # int4's
    Grid("kconvert", 7.0, -8, 7, torch.float32, True),
    Grid("minmax", INT4_HALF_RANGE, -8, 7, torch.bfloat16, False),
    Grid("kimi", 7.0, -7, 7, torch.bfloat16, False),
)}
NVFP4 = Nvfp4Grid()
CALIBRATION_GRIDS = {**GRIDS, NVFP4.name: NVFP4}  # every grid `--calibrate` may run on, by kconvert.json's name


class Hessian:
    """The running sum of x x^T over every token a linear saw (float32, [in, in]) and the token count."""

    def __init__(self, cols: int, device="cpu"):
        self.sum = torch.zeros(cols, cols, dtype=torch.float32, device=device)
        self.tokens = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).to(torch.float32)
        self.sum.addmm_(x.T, x)
        self.tokens += x.shape[0]


def group_scales(w: torch.Tensor, group: int, grid: Grid, search: str = "mse", name: str = "") -> torch.Tensor:
    """The static scales [R, C/group] of w by the grid's rule (as stored: bf16 for compressed-tensors' grids)."""
    rule = search if grid.search else "amax"
    return int4_group_codes(w, group, grid.half_range, rule, grid.scale_dtype, name,
                            floor_zeros_only=grid.scale_dtype == torch.bfloat16)[1]


def inverse_factor(H: torch.Tensor, damp: float = DAMP) -> tuple[torch.Tensor, float]:
    """(upper Cholesky factor of H^-1 after damping, the damping fraction used). Columns no token touched
    (zero diagonal) get a unit diagonal: no error flows through them, they round to nearest. A matrix that
    stays indefinite after MAX_DAMP_TRIES gets the identity (rounding to nearest for the whole weight)."""
    H = H.to(torch.float64).clone()
    diag = H.diagonal()
    diag[diag <= 0] = 1.0
    mean = float(diag.mean())
    for i in range(MAX_DAMP_TRIES):
        frac = damp * 10 ** i
        L, info = torch.linalg.cholesky_ex(H + frac * mean * torch.eye(H.shape[0], dtype=H.dtype))
        if int(info) == 0:
            inv = torch.cholesky_inverse(L)
            U, info = torch.linalg.cholesky_ex(inv, upper=True)
            if int(info) == 0:
                return U.to(torch.float32), frac
    return torch.eye(H.shape[0]), float("inf")


def gptq_codes(w: torch.Tensor, H: torch.Tensor, scale: torch.Tensor, group: int, grid: Grid | Nvfp4Grid, *,
               damp: float = DAMP, act_order: bool = True, block: int = BLOCK) -> torch.Tensor:
    """Codes [R, C] (the grid's code_dtype) of w [R, C] under the fixed group `scale` [R, C/group], by GPTQ with
    Hessian H [C, C]: each column rounded by `grid.nearest`, its error fed into the columns not yet visited."""
    rows, cols = w.shape
    order = torch.argsort(H.diagonal(), descending=True, stable=True) if act_order else torch.arange(cols)
    W = w.to(torch.float32)[:, order].clone()
    S = scale.to(torch.float32).repeat_interleave(group, dim=1)[:, order]  # each column's own group scale
    U, _ = inverse_factor(H[order][:, order], damp)
    Q = torch.empty(rows, cols, dtype=torch.float32)
    for a in range(0, cols, block):
        b = min(cols, a + block)
        Wb, Ub, err = W[:, a:b], U[a:b, a:b], torch.empty(rows, b - a)
        for i in range(b - a):
            s = S[:, a + i]
            q, v = grid.nearest(Wb[:, i], s)
            Q[:, a + i] = q
            e = (Wb[:, i] - v) / Ub[i, i]
            Wb[:, i:].sub_(e[:, None] * Ub[i, i:][None, :])
            err[:, i] = e
        W[:, b:].sub_(err @ U[a:b, b:])
    codes = torch.empty_like(Q)
    codes[:, order] = Q
    return codes.to(grid.code_dtype)


def gptq_quantize(w: torch.Tensor, H: torch.Tensor | None, group: int, grid: Grid, *, search: str = "mse",
                  damp: float = DAMP, act_order: bool = True, name: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes [R, C], scale [R, C/group]) of w: static group scales, then GPTQ codes. H None: no
    calibration tokens reached this weight; it rounds to nearest with the same scales."""
    scale = group_scales(w, group, grid, search, name)
    if H is None:
        S = scale.to(torch.float32).repeat_interleave(group, dim=1)
        return torch.clamp(torch.round(w.to(torch.float32) / S), grid.qmin, grid.qmax).to(torch.int8), scale
    return gptq_codes(w, H, scale, group, grid, damp=damp, act_order=act_order), scale
