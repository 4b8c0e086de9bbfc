"""`int4`: symmetric 4-bit weights, one scale per group of G inputs of a row, values -8..7; routed
experts only by default (as Kimi's INT4 releases). One group quantizer (`int4_group_codes`), two
encodings of its codes (packing.py):

- kconvert (`shard --quant int4`): `X.weight_packed` U8 [R, C/2] nibble pairs + `X.weight_scale` F32
  [R, C/G]; scale = amax / 7 shrunk by the clipping factor 1 - 0.02 k, k = 0..15, that gives the least
  squared error for the group, first such k on ties (`int4_scales="amax"` keeps k = 0).
- compressed-tensors (`export --format w4a16`, pack-quantized): `X.weight_packed` I32 [R, C/8] +
  `X.weight_scale` BF16 [R, C/G] + `X.weight_shape` I32 [2]; compressed-tensors' min-max rule
  scale = bf16(amax / 7.5) (the half-range of [-8, 7]), only a zero scale raised to 1e-12. An INT4
  pack-quantized source with the same G is copied as it is.
dequant = q * scale of the group. Formulas: docs/FORMAT.md, docs/EXPORT.md.
"""

from __future__ import annotations

from kconvert.errors import CheckpointError
from kconvert.quant.chunks import TINY, check_scales, row_chunks
from kconvert.quant.packing import pack_int32_words, pack_nibble_pairs, unpack_int32_words, unpack_nibble_pairs
from kconvert.quant.scheme import COMPRESSED_TENSORS, LosslessCopy, Options, Scheme, SourceQuant, Spec

INT4_SCALES = ("mse", "amax")  # kconvert encoding: clipping search, or plain amax / 7
INT4_CLIP_STEPS, INT4_CLIP_STEP = 16, 0.02
INT4_HALF_RANGE = 7.5  # compressed-tensors: (7 - (-8)) / 2


def int4_group_codes(w: torch.Tensor, group: int, half_range: float = 7.0, search: str = "amax",
                     scale_dtype: torch.dtype | None = None, name: str = "",
                     floor_zeros_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """w [R, C] float (C a multiple of `group`) -> (int8 codes -8..7 [R, C], scale [R, C/group] in scale_dtype).

    s_k = scale_dtype(amax (1 - 0.02 k) / half_range) raised to 1e-12 (`floor_zeros_only`: only a zero
    scale is, as compressed-tensors' rule), q_k = clamp(round(w / s_k), -8, 7), computed with the
    scale as stored (a bf16 scale is rounded first: what a reader multiplies by); `search="mse"` keeps
    the k in 0..15 with the least squared error of the group (first on ties). Float32 scales unless
    `scale_dtype`."""
    import torch

    scale_dtype = scale_dtype or torch.float32
    rows, cols = w.shape
    codes = torch.empty(rows, cols, dtype=torch.int8)
    scale = torch.empty(rows, cols // group, dtype=scale_dtype)
    for r0, r1 in row_chunks(rows, cols):
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
    check_scales(scale, w, name)
    return codes, scale


def quantize_int4_group(w: torch.Tensor, group: int = 32, search: str = "mse",
                        name: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """kconvert encoding: w [R, C] float (C a multiple of `group`, even) -> (uint8 [R, C/2] nibble pairs,
    float32 scale [R, C/group])."""
    import torch

    codes, scale = int4_group_codes(w, group, 7.0, search, torch.float32, name)
    return pack_nibble_pairs(codes), scale


def quantize_int4_packed(w: torch.Tensor, group: int = 32, name: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors encoding: w [R, C] float -> (int32 [R, C/8] packed, bf16 scale [R, C/group])."""
    import torch

    rows, cols = w.shape
    if cols % group or cols % 8:
        raise CheckpointError(f"in_features {cols} is not a multiple of the group size {group} (and of 8)", tensor=name)
    codes, scale = int4_group_codes(w, group, INT4_HALF_RANGE, "amax", torch.bfloat16, name, floor_zeros_only=True)
    return pack_int32_words(codes), scale


def dequantize_int4(codes: torch.Tensor, scale: torch.Tensor, group: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """int8 codes [R, C] times the scale of each column's group -> [R, C] in `dtype` (float32 unless given;
    both cast first)."""
    import torch

    dtype = dtype or torch.float32
    rows, cols = codes.shape
    c, s = codes.to(dtype), scale.to(dtype)
    if cols % group == 0 and s.shape[1] == cols // group:  # each group's scale broadcast, not repeated
        return (c.view(rows, cols // group, group) * s[..., None]).view(rows, cols)
    return c * s.repeat_interleave(group, dim=1)[:, :cols]


class Int4Group(Scheme):
    name = "int4"
    copies = ("int4_copy",)
    experts_only = True

    def option_problem(self, opts: Options) -> str | None:
        if opts.group_size < 2 or opts.group_size % 2:  # two codes a byte: groups must not split one
            return f"--group-size must be an even number >= 2, got {opts.group_size}"
        return None

    def misfit(self, shape: tuple[int, ...], opts: Options) -> str | None:
        if shape[1] % opts.group_size:
            return f"{shape[1]} inputs per rank do not divide into groups of {opts.group_size}; choose another --group-size"
        return None

    def specs(self, src: str, shape: tuple[int, ...], opts: Options) -> list[Spec]:
        r, c = shape
        groups = -(-c // opts.group_size)
        if opts.encoding == COMPRESSED_TENSORS:
            return [(src + "_packed", "I32", (r, c // 8)), (src + "_scale", "BF16", (r, groups)), (src + "_shape", "I32", (2,))]
        return [(src + "_packed", "U8", (r, c // 2)), (src + "_scale", "F32", (r, groups))]

    def quantize(self, w: torch.Tensor, opts: Options, name: str = "") -> list[torch.Tensor]:
        import torch

        if opts.encoding == COMPRESSED_TENSORS:
            packed, scale = quantize_int4_packed(w, opts.group_size, name)
            return [packed, scale, torch.tensor(list(w.shape), dtype=torch.int32)]
        return list(quantize_int4_group(w, opts.group_size, opts.int4_scales, name))

    def encode(self, codes: torch.Tensor, scale: torch.Tensor, opts: Options) -> list[torch.Tensor]:
        """Codes -8..7 and group scales chosen elsewhere (calibrated: kconvert/quant/gptq.py), as stored."""
        import torch

        if opts.encoding == COMPRESSED_TENSORS:
            return [pack_int32_words(codes), scale.to(torch.bfloat16), torch.tensor(list(codes.shape), dtype=torch.int32)]
        return [pack_nibble_pairs(codes), scale.to(torch.float32)]

    def dequantize(self, stored: list[torch.Tensor], opts: Options, dtype: torch.dtype | None = None) -> torch.Tensor:
        if opts.encoding == COMPRESSED_TENSORS:
            codes = unpack_int32_words(stored[0], int(stored[2][1]))
        else:
            codes = unpack_nibble_pairs(stored[0])
        return dequantize_int4(codes, stored[1], opts.group_size, dtype)

    def lossless_copy(self, source: SourceQuant, opts: Options, *, same_scale_format: bool = False) -> LosslessCopy | None:
        """A pack-quantized source with the same group, into the same (compressed-tensors) encoding."""
        if opts.encoding == COMPRESSED_TENSORS and source.format == "int4_packed" and source.group == opts.group_size:
            return LosslessCopy("int4_copy", ("packed", "scale", "shape"))
        return None


SCHEME = Int4Group()
