"""Target quantizers for `kconvert shard` and `kconvert export` (one implementation per format).

FP8: float8_e4m3fn with one float32 scale per 128x128 block (DeepSeek's `weight_scale_inv`,
dequant = w * scale); with `ue8m0` the scale is rounded up to a power of two (2^ceil(log2(amax/448))),
as DeepSeek-V3.1/V3.2 store it. INT8 / FP8-channel: symmetric, one float32 scale per output row
(amax / 127, amax / 448). INT4: symmetric, one scale per group of `group` inputs of a row
(`int4_group_codes`), values -8..7; two packers: `pack_nibbles` (shard: nibbles q + 8, two per byte,
even column in the low nibble, float32 scale amax / 7 shrunk by the clipping factor 1 - 0.02 k,
k = 0..15, that gives the least squared error for the group, first such k on ties; `search="amax"`
keeps k = 0) and int4_pack.py (compressed-tensors pack-quantized: amax / 7.5, bf16 scale, eight
nibbles per int32). Formulas: docs/FORMAT.md, docs/EXPORT.md.

Speed and memory: each quantizer walks the weight in row chunks of about CHUNK_ELEMS values (whole
128-row blocks for FP8), so its float32 temporaries stay cache-sized and are reused by the allocator
instead of float32 copies of the whole tensor, and the block / row / group scale is broadcast over
the chunk (never expanded to the weight's size). Results are bit-identical to the whole-tensor form.
All refuse non-finite input: a NaN in a source weight is a broken checkpoint, not something to round.
NaN and Inf propagate into the amax the scales come from, so a non-finite scale is the (free) check.
"""

from __future__ import annotations

import torch

from kconvert.errors import CheckpointError
from kconvert.io.dtypes import FP8_BLOCK

FP8_MAX = 448.0  # float8_e4m3fn, no infinities
INT8_MAX = 127.0
TINY = 1e-12  # scale floor for all-zero blocks/rows (keeps dequant exact: 0 * tiny = 0)
CHUNK_ELEMS = 1 << 20  # values per step: a 4 MB float32 temporary


def check_finite(x: torch.Tensor, name: str) -> None:
    if x.is_floating_point() and x.numel():
        lo, hi = torch.aminmax(x)  # no tensor-sized temporary (isfinite(x) would allocate one)
        if not (bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))):
            _refuse(x, name)


def _refuse(x: torch.Tensor, name: str) -> None:
    bad = int((~torch.isfinite(x.to(torch.float32))).sum())
    raise CheckpointError(f"{bad} NaN/Inf values in the source weight: refusing to quantize it", tensor=name)


def _check_scales(scale: torch.Tensor, w: torch.Tensor, name: str) -> None:
    if scale.numel() and not bool(torch.isfinite(scale).all()):
        _refuse(w, name)


def _row_chunks(rows: int, cols: int, unit: int = 1):
    """(r0, r1) row ranges of about CHUNK_ELEMS values, each a multiple of `unit` rows (but the last)."""
    step = unit * max(1, CHUNK_ELEMS // max(1, unit * cols))
    return ((r, min(rows, r + step)) for r in range(0, rows, step))


def _fold_max(a: torch.Tensor, dim: int, block: int, signed: bool = False) -> torch.Tensor:
    """amax (of |a| when `signed`) over consecutive runs of `block` along `dim` (a shorter last run
    counts on its own). |a| comes from amax and amin: two reads and no |a| temporary."""
    def absmax(v: torch.Tensor, d: int, keepdim: bool = False) -> torch.Tensor:
        hi = v.amax(d, keepdim=keepdim)
        return torch.maximum(hi, v.amin(d, keepdim=keepdim).neg_()) if signed else hi

    n = a.shape[dim]
    full = n - n % block
    parts = []
    if full:
        parts.append(absmax(a.narrow(dim, 0, full).unflatten(dim, (full // block, block)), dim + 1))
    if n > full:
        parts.append(absmax(a.narrow(dim, full, n - full), dim, keepdim=True))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def _divide_blocks(x: torch.Tensor, s: torch.Tensor, block: int, out: torch.Tensor) -> None:
    """out = e4m3(x / s[r // block, c // block]), the scale broadcast over each block. No clamp to ±448
    is needed: s >= amax / 448 up to one rounding, so |x / s| <= 448 (1 + 2^-22), which e4m3's
    round-to-nearest-even maps to ±448 exactly as the clamped value (tests/test_export.py checks)."""
    r, c = x.shape
    s_rows = s.repeat_interleave(block, 0)[:r]  # [r, blocks across]: small
    full = c - c % block
    if full:
        y = x[:, :full].unflatten(1, (full // block, block)) / s_rows[:, : full // block, None]
        out[:, :full].unflatten(1, (full // block, block)).copy_(y)
    if c > full:
        out[:, full:].copy_(x[:, full:] / s_rows[:, -1:])


def quantize_fp8_block(w: torch.Tensor, block: int = FP8_BLOCK, scale_format: str = "fp32",
                       name: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """w [R, C] float -> (fp8 [R, C], float32 scale [ceil(R/b), ceil(C/b)]) with w ≈ q * scale."""
    rows, cols = w.shape
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scale = torch.full((-(-rows // block), -(-cols // block)), TINY, dtype=torch.float32)
    if not q.numel():
        return q, scale
    for r0, r1 in _row_chunks(rows, cols, block):
        x = w[r0:r1].to(torch.float32)  # w itself when already float32: only read below
        s = (_fold_max(_fold_max(x, 1, block, signed=True), 0, block) / FP8_MAX).clamp_min_(TINY)
        if scale_format == "ue8m0":
            s = torch.exp2(torch.ceil(torch.log2(s)))
        scale[r0 // block: r0 // block + s.shape[0]] = s
        _divide_blocks(x, s, block, q[r0:r1])
    _check_scales(scale, w, name)
    return q, scale


def _quantize_rows(w: torch.Tensor, limit: float, dtype: torch.dtype, rounded: bool, name: str):
    rows, cols = w.shape
    q = torch.empty(rows, cols, dtype=dtype)
    scale = torch.full((rows, 1), TINY, dtype=torch.float32)
    if not q.numel():
        return q, scale
    for r0, r1 in _row_chunks(rows, cols):
        x = w[r0:r1].to(torch.float32)
        s = (_fold_max(x, 1, cols, signed=True) / limit).clamp_min_(TINY)
        scale[r0:r1] = s
        y = x / s  # |y| <= limit (1 + 2^-22): see _divide_blocks; int8 rounds it to ±127 all the same
        q[r0:r1].copy_(y.round_() if rounded else y)
    _check_scales(scale, w, name)
    return q, scale


def quantize_int8_channel(w: torch.Tensor, name: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """w [R, C] float -> (int8 [R, C], float32 scale [R, 1]) with w ≈ q * scale."""
    return _quantize_rows(w, INT8_MAX, torch.int8, True, name)


def quantize_fp8_channel(w: torch.Tensor, name: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """w [R, C] float -> (float8_e4m3fn [R, C], float32 scale [R, 1]) with w ≈ q * scale (scale = row amax / 448)."""
    return _quantize_rows(w, FP8_MAX, torch.float8_e4m3fn, False, name)


INT4_SEARCH = ("mse", "amax")
INT4_CLIP_STEPS, INT4_CLIP_STEP = 16, 0.02


def int4_group_codes(w: torch.Tensor, group: int, half_range: float = 7.0, search: str = "amax",
                     scale_dtype: torch.dtype = torch.float32, name: str = "",
                     floor_zeros_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """w [R, C] float (C a multiple of `group`) -> (int8 codes -8..7 [R, C], scale [R, C/group] in scale_dtype).

    s_k = scale_dtype(amax (1 - 0.02 k) / half_range) raised to 1e-12 (`floor_zeros_only`: only a zero
    scale is, as compressed-tensors' rule), q_k = clamp(round(w / s_k), -8, 7), computed with the
    scale as stored (a bf16 scale is rounded first: what a reader multiplies by); `search="mse"` keeps
    the k in 0..15 with the least squared error of the group (first on ties)."""
    rows, cols = w.shape
    codes = torch.empty(rows, cols, dtype=torch.int8)
    scale = torch.empty(rows, cols // group, dtype=scale_dtype)
    for r0, r1 in _row_chunks(rows, cols):
        g = w[r0:r1].to(torch.float32).reshape(r1 - r0, cols // group, group)
        amax = g.abs().amax(dim=-1, keepdim=True)
        best_q = best_s = best_err = None
        for k in range(INT4_CLIP_STEPS if search == "mse" else 1):
            s = (amax * (1 - INT4_CLIP_STEP * k) / half_range).to(scale_dtype)
            s = (torch.where(s > 0, s, torch.full_like(s, TINY)) if floor_zeros_only else s.clamp_min_(TINY)).float()
            q = torch.round(g / s).clamp_(-8, 7)
            if search != "mse":
                best_q, best_s = q, s
                break
            err = (q * s - g).pow_(2).sum(-1, keepdim=True)
            if best_q is None:
                best_q, best_s, best_err = q, s, err
                continue
            better = err < best_err
            best_q, best_s, best_err = torch.where(better, q, best_q), torch.where(better, s, best_s), torch.minimum(err, best_err)
        codes[r0:r1] = best_q.view(r1 - r0, cols)
        scale[r0:r1] = best_s.view(r1 - r0, cols // group)
    _check_scales(scale, w, name)
    return codes, scale


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes -8..7 [R, C] -> uint8 [R, C/2]: q + 8, even column in the low nibble."""
    u = (codes + 8).to(torch.uint8)
    return (u[:, 0::2] | (u[:, 1::2] << 4)).contiguous()


def quantize_int4_group(w: torch.Tensor, group: int = 32, search: str = "mse",
                        name: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """w [R, C] float (C a multiple of `group`, even) -> (uint8 [R, C/2] packed nibbles, float32 scale [R, C/group])."""
    codes, scale = int4_group_codes(w, group, 7.0, search, torch.float32, name)
    return pack_nibbles(codes), scale


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [R, C/2] -> int8 values -8..7 [R, C] (low nibble = even column)."""
    u = torch.stack([packed & 0xF, packed >> 4], dim=-1).view(packed.shape[0], -1)
    return u.to(torch.int8) - 8
