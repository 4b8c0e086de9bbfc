"""`fp4`: FP4 e2m1 weights with one power-of-two (e8m0) scale per 32 inputs of a row: MXFP4, the
storage of DeepSeek-V4's routed experts. Routed experts only by default, as released.

- `X.weight_packed` U8 [R, C/2]: two 4-bit codes a byte, even column in the low nibble (the release's
  int8 bytes, bit for bit). A code is sign (bit 3) and magnitude index m (bits 0-2) into
  E2M1 = (0, 0.5, 1, 1.5, 2, 3, 4, 6).
- `X.weight_scale` F8_E8M0 [R, C/32]: byte e, scale 2^(e - 127); 255 is NaN (refused on read).
dequant = (-1)^sign * E2M1[m] * 2^(e - 127).

Quantizing: per group, scale = 2^ceil(log2(amax / 6)) (the largest |w| lands on 6 or below, nothing
saturates), clamped to e8m0's 2^-127..2^127; each w / scale goes to the nearest e2m1 value, ties to the
even code (IEEE round-to-nearest-even on the 1-bit mantissa); a value that rounds to 0 keeps code 0
(no negative zero). Formula: docs/FORMAT.md.
"""

from __future__ import annotations

from kconvert.io.dtypes import FP4_GROUP, e8m0_to_float
from kconvert.quant.chunks import check_scales, row_chunks
from kconvert.quant.scheme import DEEPSEEK_V4, LosslessCopy, Options, Scheme, SourceQuant, Spec, sidecar

GROUP = FP4_GROUP  # MXFP4: one scale per 32 inputs (io/dtypes.py: folding headers needs it without this module)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E8M0_BIAS, E8M0_MIN, E8M0_MAX = 127, -127, 127  # exponents of bytes 0..254; byte 255 is NaN
# Midpoints between neighbouring magnitudes, and whether a tie goes up (the upper code is even).
_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def e8m0_exponents(amax: torch.Tensor) -> torch.Tensor:
    """int32 exponent e of each group's scale 2^e: the least e with amax / 2^e <= 6 (clamped to e8m0)."""
    import torch

    mantissa, exp = torch.frexp(amax / E2M1_MAX)  # amax / 6 = m * 2^exp, m in [0.5, 1) (0 for amax = 0)
    e = torch.where(mantissa == 0.5, exp - 1, exp)  # an exact power of two needs no rounding up
    # the division rounds: make sure the largest value really fits under 6 at 2^e
    e = torch.where(amax / torch.exp2(e.to(torch.float32)) > E2M1_MAX, e + 1, e)
    return torch.where(amax > 0, e, torch.full_like(e, E8M0_MIN)).clamp_(E8M0_MIN, E8M0_MAX).to(torch.int32)


def e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """float y (already divided by its scale, |y| <= 6) -> uint8 codes 0..15 (sign bit 3)."""
    import torch

    a = y.abs()
    m = torch.zeros(y.shape, dtype=torch.uint8)
    for mid, tie_up in _MIDPOINTS:
        m += (a >= mid) if tie_up else (a > mid)
    return torch.where((y < 0) & (m > 0), m | 8, m)


def quantize_fp4(w: torch.Tensor, name: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """w [R, C] float (C a multiple of 32) -> (uint8 [R, C/2] code pairs, float8_e8m0fnu [R, C/32])."""
    import torch

    rows, cols = w.shape
    packed = torch.empty(rows, cols // 2, dtype=torch.uint8)
    exps = torch.empty(rows, cols // GROUP, dtype=torch.int32)
    for r0, r1 in row_chunks(rows, cols):
        g = w[r0:r1].to(torch.float32).reshape(r1 - r0, cols // GROUP, GROUP)
        amax = g.abs().amax(dim=-1, keepdim=True)
        check_scales(amax, w, name)  # NaN/Inf in the weight: refuse
        e = e8m0_exponents(amax)
        codes = e2m1_codes(g / torch.exp2(e.to(torch.float32))).view(r1 - r0, cols)
        packed[r0:r1] = codes[:, 0::2] | (codes[:, 1::2] << 4)
        exps[r0:r1] = e.view(r1 - r0, cols // GROUP)
    return packed, (exps + E8M0_BIAS).to(torch.uint8).view(torch.float8_e8m0fnu)


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """uint8 [R, C/2] code pairs and e8m0 [R, C/32] scales -> [R, C] in `dtype` (exact in float32)."""
    import torch

    dtype = dtype or torch.float32
    if packed.device.type == "cpu" and packed.dim() == 2 and packed.shape[-1] == scale.shape[-1] * (GROUP // 2):
        return _dequantize_by_table(packed, scale).to(dtype)
    lut = torch.tensor(E2M1 + tuple(-v for v in E2M1), dtype=torch.float32).to(packed.device)  # indexed on the codes' device
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).view(packed.shape[0], -1)
    return (lut[codes.long()] * e8m0_to_float(scale).repeat_interleave(GROUP, dim=1)).to(dtype)


_PAIR_VALUES = []  # the table below, made on first use


def _pair_values():
    """float32 [256 scale bytes, 256 code pair bytes, 2]: each pair's two values under each e8m0 scale, made by the
    product dequantize_fp4 computes (the code's value times e8m0_to_float of the scale), so a lookup has its bits."""
    import torch

    if not _PAIR_VALUES:
        lut = torch.tensor(E2M1 + tuple(-v for v in E2M1), dtype=torch.float32)
        pair = torch.arange(256)
        codes = torch.stack([lut[pair & 0xF], lut[pair >> 4]], dim=-1)  # [pair, 2]
        scales = e8m0_to_float(torch.arange(256, dtype=torch.uint8).view(torch.float8_e8m0fnu))  # [scale]
        _PAIR_VALUES.append((codes[None] * scales[:, None, None]).contiguous())
    return _PAIR_VALUES[0]


def _dequantize_by_table(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """dequantize_fp4 on the CPU as one lookup per code pair byte (its group's scale byte, then the pair): numpy's take
    over a 512 KiB table, not a float32 product over every value (4x the memory traffic a byte)."""
    import numpy as np
    import torch

    rows, groups = scale.shape[0], scale.shape[-1]
    at = ((scale.contiguous().view(torch.uint8).numpy().astype(np.uint16) << 8)[..., None]  # the scale's table,
          + packed.contiguous().numpy().reshape(rows, groups, GROUP // 2))  # then the pair's entry in it
    pairs = np.take(_pair_values().view(-1, 2).view(torch.float64).view(-1).numpy(), at)  # 8 bytes: both values
    return torch.from_numpy(pairs).view(torch.float32).view(rows, -1)


class Fp4E2M1(Scheme):
    name = "fp4"
    experts_only = True
    copies = ("fp4_copy",)

    def option_problem(self, opts: Options) -> str | None:
        if opts.group_size != GROUP:
            return f"--quant fp4 stores one e8m0 scale per {GROUP} inputs (MXFP4); --group-size {opts.group_size} does not apply"
        return None

    def misfit(self, shape: tuple[int, ...], opts: Options) -> str | None:
        if shape[1] % GROUP:
            return f"{shape[1]} inputs per rank do not divide into fp4's groups of {GROUP}"
        return None

    def specs(self, src: str, shape: tuple[int, ...], opts: Options) -> list[Spec]:
        r, c = shape
        if opts.encoding == DEEPSEEK_V4:  # as released: the code pairs as int8 `X.weight`, a `X.scale` sidecar
            return [(src, "I8", (r, c // 2)), (sidecar(src), "F8_E8M0", (r, c // GROUP))]
        return [(src + "_packed", "U8", (r, c // 2)), (src + "_scale", "F8_E8M0", (r, c // GROUP))]

    def quantize(self, w: torch.Tensor, opts: Options, name: str = "") -> list[torch.Tensor]:
        import torch

        packed, scale = quantize_fp4(w, name)
        return [packed.view(torch.int8) if opts.encoding == DEEPSEEK_V4 else packed, scale]

    def dequantize(self, stored: list[torch.Tensor], opts: Options, dtype: torch.dtype | None = None) -> torch.Tensor:
        import torch

        dtype = dtype or torch.float32
        return dequantize_fp4(stored[0].view(torch.uint8), stored[1], dtype)

    def lossless_copy(self, source: SourceQuant, opts: Options, *, same_scale_format: bool = False) -> LosslessCopy | None:
        """DeepSeek-V4's FP4 experts (int8 code pairs + e8m0 per 32): the very bytes, whole tensors only."""
        if source.format != "fp4_packed":
            return None
        return LosslessCopy("fp4_copy", ("weight", "scale"), GROUP, whole=True)


SCHEME = Fp4E2M1()
