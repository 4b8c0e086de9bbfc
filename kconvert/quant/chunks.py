"""Helpers every chunked quantizer shares.

Each quantizer walks the weight in row chunks of about CHUNK_ELEMS values (whole 128-row blocks for
block FP8), so its float32 temporaries stay cache-sized and are reused by the allocator instead of
float32 copies of the whole tensor, and the block / row / group scale is broadcast over the chunk
(never expanded to the weight's size). Results are bit-identical to the whole-tensor form.
All refuse non-finite input: a NaN in a source weight is a broken checkpoint, not something to round.
NaN and Inf propagate into the amax the scales come from, so a non-finite scale is the (free) check.
"""

from __future__ import annotations

from kconvert.errors import CheckpointError
from kconvert.quant.scheme import Options, Scheme, Spec

FP8_MAX = 448.0  # float8_e4m3fn, no infinities
INT8_MAX = 127.0
TINY = 1e-12  # scale floor for all-zero blocks/rows (keeps dequant exact: 0 * tiny = 0)
CHUNK_ELEMS = 1 << 20  # values per step: a 4 MB float32 temporary


def refuse_nonfinite(x: torch.Tensor, name: str) -> None:
    import torch

    bad = int((~torch.isfinite(x.to(torch.float32))).sum())
    raise CheckpointError(f"{bad} NaN/Inf values in the source weight: refusing to quantize it", tensor=name)


def check_scales(scale: torch.Tensor, w: torch.Tensor, name: str) -> None:
    """A non-finite scale means a non-finite weight: refuse it (counting the bad values only then)."""
    import torch

    if scale.numel() and not bool(torch.isfinite(scale).all()):
        refuse_nonfinite(w, name)


def row_chunks(rows: int, cols: int, unit: int = 1):
    """(r0, r1) row ranges of about CHUNK_ELEMS values, each a multiple of `unit` rows (but the last)."""
    step = unit * max(1, CHUNK_ELEMS // max(1, unit * cols))
    return ((r, min(rows, r + step)) for r in range(0, rows, step))


def fold_max(a: torch.Tensor, dim: int, block: int, signed: bool = False) -> torch.Tensor:
    """amax (of |a| when `signed`) over consecutive runs of `block` along `dim` (a shorter last run
    counts on its own). |a| comes from amax and amin: two reads and no |a| temporary."""
    import torch

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


def quantize_rows(w: torch.Tensor, limit: float, dtype: torch.dtype, rounded: bool, name: str):
    """w [R, C] float -> (q [R, C] in `dtype`, float32 scale [R, 1] = max(row amax / limit, TINY))."""
    import torch

    rows, cols = w.shape
    q = torch.empty(rows, cols, dtype=dtype)
    scale = torch.full((rows, 1), TINY, dtype=torch.float32)
    if not q.numel():
        return q, scale
    for r0, r1 in row_chunks(rows, cols):
        x = w[r0:r1].to(torch.float32)
        s = (fold_max(x, 1, cols, signed=True) / limit).clamp_min_(TINY)
        scale[r0:r1] = s
        y = x / s  # |y| <= limit (1 + 2^-22): see fp8_block.divide_blocks; int8 rounds it to ±127 all the same
        q[r0:r1].copy_(y.round_() if rounded else y)
    check_scales(scale, w, name)
    return q, scale


class RowScaled(Scheme):
    """A scheme of one float32 scale per output row (`X.weight` in `tag`, `X.weight_scale` [R, 1]):
    s = max(row amax / limit, 1e-12), q = dtype(w / s) (rounded first for integers), dequant = q * s."""

    tag: str  # the stored dtype (a safetensors tag)
    limit: float
    rounded: bool

    def specs(self, src: str, shape: tuple[int, ...], opts: Options) -> list[Spec]:
        return [(src, self.tag, tuple(shape)), (src + "_scale", "F32", (shape[0], 1))]

    def quantize(self, w: torch.Tensor, opts: Options, name: str = "") -> list[torch.Tensor]:
        from kconvert.io.dtypes import DTYPES

        return list(quantize_rows(w, self.limit, DTYPES[self.tag], self.rounded, name))

    def dequantize(self, stored: list[torch.Tensor], opts: Options, dtype: torch.dtype | None = None) -> torch.Tensor:
        import torch

        dtype = dtype or torch.float32
        return stored[0].to(dtype) * stored[1].to(dtype)
