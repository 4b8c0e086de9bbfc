"""Source weight formats: the stored forms of a logical weight (logical.py folds them), one dequantizer each.

- plain:        `X` stored as is (bf16 / fp16 / fp32 ...).
- block_fp8:    DeepSeek/Kimi release FP8: `X.weight` float8_e4m3fn + `X.weight_scale_inv` float32
                [ceil(out/B0), ceil(in/B1)], dequant = weight * scale of its block.
- int4_packed:  compressed-tensors pack-quantized: `X.weight_packed` int32 [out, in/8] (low nibble
                first, offset 8), `X.weight_scale` [out, in/G], `X.weight_shape` [2]; value = (q - 8) * scale.
- block_fp8 with a `.scale` sidecar (DeepSeek-V4): `X.weight` float8_e4m3fn + `X.scale`, float32 or
                float8_e8m0fnu (byte e = 2^(e - 127); 0xFF is NaN and refused), same 128x128 grid.
- fp4_packed:   DeepSeek-V4 routed experts: `X.weight` int8 [out, in/2], two FP4 e2m1 codes a byte
                (even column in the low nibble) + `X.scale` float8_e8m0fnu [out, in/32]; decoded by
                the fp4 scheme's own `dequantize_fp4` (one unpacker per on-disk layout).
- nvfp4_packed: NVFP4 (NVIDIA's V4 NVFP4 builds' experts, ModelOpt's K3): `X.weight` U8 [out, in/2] e2m1 code pairs +
                `X.weight_scale` F8_E4M3 [out, in/16] + `X.weight_scale_2` F32 (value = E2M1[code] * (scale *
                scale_2)) and `X.input_scale`; or compressed-tensors' `X.weight_packed` + `X.weight_scale` +
                `X.weight_global_scale` (value = E2M1[code] * (scale / global_scale)): the nvfp4 scheme's
                `dequantize_nvfp4`. A per-tensor scale that is NaN, Inf, zero or negative is refused, naming it.
- scaled:       compressed-tensors float-/int-quantized: `X.weight` fp8/int8 + `X.weight_scale` with a
                per-tensor (1,), per-channel (out, 1) or block grid; `X.input_scale` (static activations)
                is carried but not needed to dequantize.

Every read is checked for NaN/Inf (`require_finite`): a non-finite value in a source weight or scale
is a broken checkpoint whatever its target format (a NaN norm kept in bf16 poisons every token just as
surely as a NaN in a quantized matrix). The check is one pass over memory already held: `aminmax`
propagates NaN and Inf and allocates nothing the size of the tensor (~6 GB/s on one core).
"""

from __future__ import annotations

from kconvert.errors import CheckpointError, NonFiniteError
from kconvert.io.safetensors_read import TensorEntry, read_tensor
from kconvert.io.dtypes import FP8_BLOCK, e8m0_to_float
from kconvert.source.logical import LogicalTensor

# torch is imported by the functions that read data (the schemes' modules likewise): folding headers into
# logical tensors (inspect, plan) must not pay torch's ~1.5 s import. The dequantizers too are imported where
# data is read: inspect and plan, which read none, do not pay for loading the quant modules (~15 ms).

# 8-bit floats have no aminmax on CPU: their NaN/Inf bit patterns are tested instead (pattern & mask == mask)
_FP8_NONFINITE = {"torch.float8_e4m3fn": 0x7F, "torch.float8_e5m2": 0x7C, "torch.float8_e8m0fnu": 0xFF}  # str(dtype)
_CHUNK = 1 << 20  # bytes per step of the fp8 bit test: its temporaries stay small


# --------------------------------------------------------------------------- finiteness


def all_finite(x: torch.Tensor) -> bool:
    """True when no element of `x` is NaN or +-Inf (integer tensors always are)."""
    import torch

    if x.numel() == 0:
        return True
    mask = _FP8_NONFINITE.get(str(x.dtype))
    if mask is not None:
        flat = x.reshape(-1).view(torch.uint8).numpy()
        return not any(((flat[i:i + _CHUNK] & mask) == mask).any() for i in range(0, flat.size, _CHUNK))
    if not x.is_floating_point():
        return True
    lo, hi = torch.aminmax(x)
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))


def _count_nonfinite(x: torch.Tensor) -> int:
    import torch

    mask = _FP8_NONFINITE.get(str(x.dtype))
    if mask is not None:
        return int(((x.reshape(-1).view(torch.uint8) & mask) == mask).sum())
    return int((~torch.isfinite(x)).sum())


def require_finite(x: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    """`x` (read from `entry`) unchanged, or NonFiniteError naming the file and tensor."""
    if not all_finite(x):
        raise NonFiniteError(f"{_count_nonfinite(x)} NaN/Inf values in the source tensor: the checkpoint is damaged",
                             file=str(entry.file), tensor=entry.name)
    return x


def _require_finite_logical(out: torch.Tensor, t: LogicalTensor, rows) -> torch.Tensor:
    """A dequantized result is finite, or the stored part that made it not is named (checked only then)."""
    if all_finite(out):
        return out
    for role, entry in t.parts.items():
        if role != "shape":
            part_rows = rows if role in ("weight", "packed") else None
            require_finite(read_tensor(entry, part_rows), entry)
    raise NonFiniteError("dequantized values overflow to Inf (weight x scale out of range)", file=str(t.main.file),
                         tensor=t.name)


# The largest magnitude a stored code takes, by format (fp4 e2m1: 6; int4: -8) or by the weight's dtype.
_TOP_BY_FORMAT = {"fp4_packed": 6.0, "int4_packed": 8.0}
_TOP_BY_DTYPE = {"F8_E4M3": 448.0, "F8_E5M2": 57344.0, "I8": 128.0}
FLOAT32_MAX = 3.4028234663852886e38


def check_scale_range(t: LogicalTensor, scale: torch.Tensor) -> None:
    """The one check of stored scales, for every reader (a dequantizing read, and the lossless copies of
    stored_parts.read_parts: `--quant fp4`, fp8's exact FP4 re-encoding, export's copies): a scale times the
    largest code its format stores must stay within float32, else the scale is refused, naming it. An e8m0 byte
    0xFE is 2^127, under which FP4's code 6 is Inf: no real checkpoint holds a scale within 2^9 of float32's
    top, so the test needs the scales alone (a max over them), never the weights."""
    top = largest_code(t)
    biggest = scale_overflow(scale, top)
    if biggest is not None:
        raise scale_range_error(t, biggest, top)


def largest_code(t: LogicalTensor) -> float | None:
    """The largest magnitude `t`'s stored codes take (what its scales multiply), or None where its scales are not
    checked against float32's range."""
    return _TOP_BY_FORMAT.get(t.format) or _TOP_BY_DTYPE.get(t.parts["weight"].dtype if "weight" in t.parts else "")


def scale_range_error(t: LogicalTensor, biggest: float, top: float) -> NonFiniteError:
    """check_scale_range's refusal (also the byte copies': convert/shard/byte_copy.py), naming the scale."""
    entry = t.parts["scale"]
    return NonFiniteError(f"a scale of {biggest:.3g} decodes this tensor's codes (up to {top:g}) past float32 "
                          "(dequantized values overflow to Inf): the checkpoint is damaged", file=str(entry.file),
                          tensor=entry.name)


def scale_overflow(scale: torch.Tensor, top: float | None) -> float | None:
    """The largest of `scale` (e8m0 bytes or floats) when it times `top` (the largest code) passes float32, else
    None: check_scale_range's test, also made over a whole stack of scales (source/stacked.py)."""
    import torch

    if top is None or scale.numel() == 0:
        return None
    s = e8m0_to_float(scale) if scale.dtype == torch.float8_e8m0fnu else scale.to(torch.float32)
    biggest = float(s.abs().max())
    return biggest if biggest * top > FLOAT32_MAX else None


FP4_TOP = _TOP_BY_FORMAT["fp4_packed"]


def tensor_scales(t: LogicalTensor, parts: dict | None = None) -> dict:
    """An NVFP4 tensor's per-tensor scales by role (`scale_2` or `global_scale`, and its input scale where stored),
    read (or taken from `parts`, a copy's) and refused unless finite and positive: a zero, Inf or negative scale
    dequantizes every value to 0, Inf or the wrong sign."""
    out = {}
    for role in ("scale_2", "global_scale", "input_scale", "input_global_scale"):
        entry = t.parts.get(role)
        if entry is None:
            continue
        x = parts[role] if parts is not None and role in parts else read_tensor(entry)
        v = float(x.reshape(-1)[0])
        if not (v > 0 and v != float("inf")):
            raise NonFiniteError(f"NVFP4 {role} is {v!r}: a per-tensor scale must be finite and positive",
                                 file=str(entry.file), tensor=entry.name)
        out[role] = x
    return out


def declared_shape(t: LogicalTensor, shape_part: torch.Tensor) -> tuple[int, int]:
    """An INT4 tensor's stored weight_shape, refused unless it agrees with weight_packed (8 codes a word)."""
    declared = tuple(int(v) for v in shape_part.reshape(-1).tolist())
    if len(declared) != 2 or declared[0] != t.shape[0] or not (t.shape[1] - 8 < declared[1] <= t.shape[1]):
        raise CheckpointError(f"weight_shape {list(declared)} disagrees with weight_packed {list(t.parts['packed'].shape)}",
                              file=str(t.parts["shape"].file), tensor=t.parts["shape"].name)
    return declared


def read_checked(entry: TensorEntry, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """One stored tensor (or rows of it), refused if any value is NaN/Inf. For readers that copy stored
    parts as they are (shard's lossless block-FP8 resharding) rather than through `read_logical`."""
    return require_finite(read_tensor(entry, rows), entry)


# --------------------------------------------------------------------------- dequantizers


def dequant_int4_packed(packed: torch.Tensor, scale: torch.Tensor, shape: tuple[int, int], group: int = 32,
                        *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """compressed-tensors pack-quantized INT4 -> float (float32 unless `dtype`). packed int32 [R, C/8], scale
    [R, C/group]."""
    import torch

    from kconvert.quant.int4_group import dequantize_int4
    from kconvert.quant.packing import unpack_int32_words

    return dequantize_int4(unpack_int32_words(packed, shape[1]), scale, group).to(dtype or torch.float32)


def dequant_scaled(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK),
                   *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """compressed-tensors fp8/int8: per-tensor (1,) / per-channel (R, 1) / block-grid scale (float32 unless
    `dtype`)."""
    import torch

    from kconvert.quant.fp8_block import dequantize_fp8_block

    dtype = dtype or torch.float32
    w = weight.to(torch.float32)
    s = scale.to(torch.float32)
    if s.numel() == 1:
        return (w * s.reshape(())).to(dtype)
    if s.dim() == 2 and s.shape[1] == 1:
        return (w * s).to(dtype)
    return dequantize_fp8_block(weight, scale, block, dtype=dtype)


def read_logical(t: LogicalTensor, *, rows: tuple[int, int] | None = None, dtype: torch.dtype | None = None,
                 block: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK), group: int = 32) -> torch.Tensor:
    """Read a logical tensor (or rows [a, b) of it), dequantized. Plain tensors keep their dtype
    unless `dtype` is given; quantized ones come back as `dtype or float32`."""
    import torch

    if t.format == "plain":
        x = read_checked(t.stored, rows)  # a plain weight stores its one entry
        return x if dtype is None else x.to(dtype)
    if "input_scale" in t.parts:
        read_checked(t.parts["input_scale"])
    return _require_finite_logical(_dequantize(t, rows, dtype or torch.float32, block, group), t, rows)


def _dequantize(t: LogicalTensor, rows, out_dtype: torch.dtype, block: tuple[int, int], group: int) -> torch.Tensor:
    import torch

    from kconvert.quant.fp4_e2m1 import dequantize_fp4
    from kconvert.quant.fp8_block import dequantize_fp8_block

    a = rows[0] if rows else 0
    if t.format == "int4_packed":
        packed = read_tensor(t.parts["packed"], rows)
        scale = read_tensor(t.parts["scale"], rows)
        check_scale_range(t, scale)
        declared = declared_shape(t, read_tensor(t.parts["shape"]))
        return dequant_int4_packed(packed, scale, (packed.shape[0], declared[1]), group, dtype=out_dtype)
    if t.format == "nvfp4_packed":  # an e4m3 scale's NaN byte (0x7F / 0xFF) named as the scale's
        from kconvert.quant.nvfp4 import dequantize_nvfp4

        scale = require_finite(read_tensor(t.parts["scale"], rows), t.parts["scale"])
        ts = tensor_scales(t)
        divide = "global_scale" in ts
        return dequantize_nvfp4(read_tensor(t.parts["weight"], rows), scale, ts["global_scale" if divide else "scale_2"],
                                out_dtype, divide=divide)
    if t.format == "fp4_packed":  # 0xFF scales would decode to Inf; name them as the NaN they are
        scale = require_finite(read_tensor(t.parts["scale"], rows), t.parts["scale"])
        check_scale_range(t, scale)
        return dequantize_fp4(read_tensor(t.parts["weight"], rows).view(torch.uint8), scale, out_dtype)
    w = read_tensor(t.parts["weight"], rows)
    kind = scale_kind(t)
    srows = None
    if rows and kind == "block":
        srows = (rows[0] // block[0], -(-rows[1] // block[0]))
    elif rows and kind == "channel":
        srows = rows
    scale = read_tensor(t.parts["scale"], srows)
    if scale.dim() == 4:  # ModelOpt's block FP8 (FP8_PB_WO): [row blocks, 1, column blocks, 1]
        scale = scale[:, 0, :, 0]
    if scale.dtype == torch.float8_e8m0fnu:
        require_finite(scale, t.parts["scale"])
    else:
        scale = require_finite(scale, t.parts["scale"])  # (named as the scale's NaN before its range)
    check_scale_range(t, scale)
    if scale.dtype == torch.float8_e8m0fnu:
        scale = e8m0_to_float(scale)
    if kind == "block":
        return dequantize_fp8_block(w, scale, block, row_offset=a, dtype=out_dtype)
    return dequant_scaled(w, scale, block, dtype=out_dtype)


def scale_kind(t: LogicalTensor) -> str:
    """tensor | channel | block (how a scaled or block-FP8 weight's scale is laid out)."""
    shape = t.parts["scale"].shape
    if t.format == "block_fp8":
        return "block"
    if len(shape) <= 1 and (not shape or shape[0] == 1):
        return "tensor"
    if len(shape) == 2 and shape[1] == 1 and shape[0] == t.shape[0]:
        return "channel"
    return "block"
