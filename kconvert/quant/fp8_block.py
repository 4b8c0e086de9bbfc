"""`fp8`: float8_e4m3fn weights with one float32 scale per 128x128 block (`fp8_block`: a source stored in other
square blocks, DeepSeek-V4.1's 32 x 32, keeps its own), DeepSeek's naming (`X.weight`, `X.weight_scale_inv`
[ceil(R/b), ceil(C/b)], dequant = q * scale). With `ue8m0` the
scale is rounded up to a power of two (2^ceil(log2(amax/448))), as DeepSeek-V3.1/V3.2 store it.
Export's `fp8-block` is this scheme. A block-FP8 source with 128x128 blocks is copied, not requantized;
DeepSeek-V4's FP4 experts are re-encoded exactly (fp4_to_fp8.py), never rounded twice. In DeepSeek-V4's layout
(`deepseek-v4` / `deepseek-v4-f32` encodings) the scale is a `X.scale` sidecar, e8m0 or float32; in Model-Optimizer's
(`modelopt`: export's nvfp4, its FP8_PB_WO) a float32 `X.weight_scale` [R/b, 1, C/b, 1]."""

from __future__ import annotations

from kconvert.io.dtypes import FP8_BLOCK
from kconvert.quant import fp4_to_fp8
from kconvert.quant.chunks import FP8_MAX, TINY, check_scales, fold_max, row_chunks
from kconvert.quant.scheme import (DEEPSEEK_V4, DEEPSEEK_V4_F32, MODELOPT, LosslessCopy, Options, Scheme, SourceQuant, Spec,
                                  sidecar)


def divide_blocks(x: torch.Tensor, s: torch.Tensor, block: int, out: torch.Tensor) -> None:
    """out = e4m3(x / s[..., r // block, c // block]), the scale broadcast over each block of the last two dims
    (leading dims: a stack of weights, quant/stacked.py). No clamp to ±448 is needed: s >= amax / 448 up to one
    rounding, so |x / s| <= 448 (1 + 2^-22), which e4m3's round-to-nearest-even maps to ±448 exactly as the
    clamped value (tests/convert/test_export.py checks)."""
    r, c = x.shape[-2:]
    s_rows = s.repeat_interleave(block, -2)[..., :r, :]  # [..., r, blocks across]: small
    full = c - c % block
    if full:
        y = x[..., :full].unflatten(-1, (full // block, block)) / s_rows[..., : full // block, None]
        out[..., :full].unflatten(-1, (full // block, block)).copy_(y)
    if c > full:
        out[..., full:].copy_(x[..., full:] / s_rows[..., -1:])


def quantize_fp8_block(w: torch.Tensor, block: int = FP8_BLOCK, scale_format: str = "fp32",
                       name: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """w [R, C] float -> (fp8 [R, C], float32 scale [ceil(R/b), ceil(C/b)]) with w ≈ q * scale."""
    import torch

    rows, cols = w.shape
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scale = torch.full((-(-rows // block), -(-cols // block)), TINY, dtype=torch.float32)
    if not q.numel():
        return q, scale
    for r0, r1 in row_chunks(rows, cols, block):
        x = w[r0:r1].to(torch.float32)  # w itself when already float32: only read below
        s = (fold_max(fold_max(x, 1, block, signed=True), 0, block) / FP8_MAX).clamp_min_(TINY)
        if scale_format == "ue8m0":
            s = torch.exp2(torch.ceil(torch.log2(s)))
        scale[r0 // block: r0 // block + s.shape[0]] = s
        divide_blocks(x, s, block, q[r0:r1])
    check_scales(scale, w, name)
    return q, scale


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK),
                         *, row_offset: int = 0, dtype: torch.dtype | None = None) -> torch.Tensor:
    """weight [R, C] fp8 times the scale of each element's (row_offset + r) // B0, c // B1 block.

    `row_offset` lets a row slice starting mid-checkpoint use the right scale rows (scale_inv must
    then start at block row row_offset // B0). Float32 unless `dtype`."""
    import torch

    dtype = dtype or torch.float32
    b0, b1 = block
    rows, cols = weight.shape
    r_idx = (torch.arange(rows) + row_offset) // b0 - row_offset // b0
    c_idx = torch.arange(cols) // b1
    s = scale_inv.to(torch.float32)[r_idx][:, c_idx]
    return (weight.to(torch.float32) * s).to(dtype)


class Fp8Block(Scheme):
    name = "fp8"
    copies = ("fp8_copy", "fp4_to_fp8")

    def specs(self, src: str, shape: tuple[int, ...], opts: Options) -> list[Spec]:
        r, c = shape
        b = opts.fp8_block
        blocks = (-(-r // b), -(-c // b))
        if opts.encoding == DEEPSEEK_V4:  # V4's own: power-of-two scales as e8m0 bytes in a `.scale` sidecar
            return [(src, "F8_E4M3", tuple(shape)), (sidecar(src), "F8_E8M0", blocks)]
        if opts.encoding == DEEPSEEK_V4_F32:  # V4-Flash-Base's: float32 scales in the `.scale` sidecar
            return [(src, "F8_E4M3", tuple(shape)), (sidecar(src), "F32", blocks)]
        if opts.encoding == MODELOPT:  # Model-Optimizer's unified checkpoint
            return [(src, "F8_E4M3", tuple(shape)), (src + "_scale", "F32", (blocks[0], 1, blocks[1], 1))]
        return [(src, "F8_E4M3", tuple(shape)), (src + "_scale_inv", "F32", blocks)]

    def quantize(self, w: torch.Tensor, opts: Options, name: str = "") -> list[torch.Tensor]:
        import torch

        if opts.encoding == DEEPSEEK_V4:
            q, s = quantize_fp8_block(w, opts.fp8_block, "ue8m0", name)
            return [q, s.to(torch.float8_e8m0fnu)]  # powers of two: exact
        q, s = quantize_fp8_block(w, opts.fp8_block, opts.scale_format, name)
        return [q, s[:, None, :, None].contiguous() if opts.encoding == MODELOPT else s]

    def dequantize(self, stored: list[torch.Tensor], opts: Options, dtype: torch.dtype | None = None) -> torch.Tensor:
        import torch

        dtype = dtype or torch.float32
        w, scale = stored
        if scale.dim() == 4:  # Model-Optimizer's [R/b, 1, C/b, 1]
            scale = scale[:, 0, :, 0]
        rows, cols = w.shape
        b = opts.fp8_block
        s = scale.to(dtype).repeat_interleave(b, 0)[:rows].repeat_interleave(b, 1)[:, :cols]
        return w.to(dtype) * s

    def lossless_copy(self, source: SourceQuant, opts: Options, *, same_scale_format: bool = False) -> LosslessCopy | None:
        """A 128x128 block-FP8 source, when its scales are valid in the target format: fp32 takes any
        scale, ue8m0 only power-of-two ones (`same_scale_format`: only the very format asked for). FP4 e2m1
        experts (DeepSeek-V4): re-encoded exactly with power-of-two block scales, valid in either format."""
        b = opts.fp8_block
        if source.format == "fp4_packed":
            return LosslessCopy("fp4_to_fp8", ("weight", "scale"), b, whole=True,
                                recode=fp4_to_fp8.recoder(b, rounding=opts.requantize))
        if source.format != "block_fp8" or source.block != (b, b):
            return None
        if same_scale_format:
            ok = source.scale_format == opts.scale_format
        else:
            ok = opts.scale_format == "fp32" or source.scale_format == "ue8m0"
        if not ok:
            return None
        return LosslessCopy("fp8_copy", ("weight", "scale"), b, recode=_modelopt_grid if opts.encoding == MODELOPT else None)


def _modelopt_grid(parts, name: str = "", options=None) -> list[torch.Tensor]:
    """A copied block-FP8 weight with its scale grid in Model-Optimizer's [R/b, 1, C/b, 1] (the same values)."""
    w, s = parts
    s = s[:, 0, :, 0] if s.dim() == 4 else s
    return [w, s[:, None, :, None].contiguous()]


SCHEME = Fp8Block()
