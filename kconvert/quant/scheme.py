"""What a quantization scheme is: the one object `shard`, `export`, `plan` and the catalog ask.

A Scheme answers, for one 2-D weight:
- `takes(info)`: whether the default policy quantizes it (the manifest's `quantize` flag; schemes with
  `experts_only` take routed experts only). `--keep` / `--quantize` globs override it (policy.py).
- `misfit(shape, opts)`: why that shape cannot be stored, if so (shard refuses, export keeps bf16).
- `specs(src, shape, opts)`: the tensors it stores, as (name, safetensors tag, shape), in write order.
- `quantize(w, opts, name)`: those tensors from a float weight (chunked, refuses NaN/Inf).
- `dequantize(stored, opts, dtype)`: the weight an engine computes from them (the formula), every
  factor cast to `dtype` before the product: exact in float32; in bf16, what an engine computes per call.
- `stored_bytes(shape, opts)`: the bytes of `specs` (scales included).
- `lossless_copy(source, opts)`: the stored parts of a source it may copy unchanged (or re-encode exactly) instead.
`opts.encoding` picks how the values are laid out on disk: `kconvert` (the converted format, shard),
`compressed-tensors` (export's w4a16 and friends), `modelopt` (export's nvfp4: NVIDIA's layout), `deepseek-v4` (V4's own `.scale` sidecars in e8m0: V4-Flash and
V4-Pro, FP4 experts) or `deepseek-v4-f32` (the same sidecars in float32: V4-Flash-Base, FP8 experts), for export's
fp8-block of a V4 text model; most schemes store the same either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kconvert.family.manifest import TensorInfo
from kconvert.io.dtypes import FP8_BLOCK, ITEMSIZE, specs_bytes

Spec = tuple[str, str, tuple[int, ...]]  # (tensor name, safetensors dtype tag, shape)
KCONVERT = "kconvert"
COMPRESSED_TENSORS = "compressed-tensors"
DEEPSEEK_V4 = "deepseek-v4"  # DeepSeek-V4's release layout: `X.weight` + a `X.scale` e8m0 sidecar (export's fp8-block)
# the same layout with float32 `X.scale` sidecars: V4-Flash-Base's (`expert_dtype: fp8`), the scale dtype vLLM reads there
DEEPSEEK_V4_F32 = "deepseek-v4-f32"
V4_ENCODINGS = (DEEPSEEK_V4, DEEPSEEK_V4_F32)  # `X.weight` + `X.scale` sidecars, whichever the scales' dtype
# NVIDIA Model-Optimizer's unified checkpoint (export's nvfp4): NVFP4 as the kconvert encoding, block FP8 as
# `X.weight_scale` [R/128, 1, C/128, 1] (its FP8_PB_WO)
MODELOPT = "modelopt"
SCALE_FORMATS = ("fp32", "ue8m0")


@dataclass(frozen=True)
class Options:
    """The knobs of one quantization run (each scheme reads the ones it has)."""

    scale_format: str = "fp32"  # block fp8: fp32 | ue8m0 (power-of-two scales)
    group_size: int = 32  # int4: inputs per scale
    int4_scales: str = "mse"  # int4, kconvert encoding: clipping search "mse" | plain "amax"
    encoding: str = KCONVERT  # how values are laid out on disk: KCONVERT | COMPRESSED_TENSORS
    fp8_block: int = FP8_BLOCK  # block fp8: rows = columns of one scale's block (a 32 x 32 source keeps its own)
    requantize: bool = False  # `shard --requantize`: what a source's own scales cannot hold exactly is rounded
    # nvfp4: the per-tensor scale to use (a fused w1/w3 pair's shared one, or a sliced tensor's whole one), set per
    # weight by shard and export; None: the weight's own
    tensor_scale: float | None = None


@dataclass(frozen=True)
class SourceQuant:
    """How the source stores one weight, from its headers and config (what a lossless copy depends on)."""

    format: str  # source.formats.LogicalTensor.format: plain | block_fp8 | int4_packed | scaled
    block: tuple[int, int] = (0, 0)  # block_fp8: the scale block
    scale_format: str = "fp32"  # block_fp8: fp32 | ue8m0
    group: int = 0  # int4_packed: inputs per scale
    parts: tuple[str, ...] = ()  # the roles of its stored parts (an NVFP4 source's input_scale is optional)


@dataclass(frozen=True)
class LosslessCopy:
    """Stored source parts written unchanged instead of quantizing (no rounding twice)."""

    transform: str  # the plan's and kconvert.json's name for it: fp8_copy, int4_copy, fp4_to_fp8
    roles: tuple[str, ...]  # source parts (LogicalTensor.parts keys), in the order of the scheme's specs
    block: int = 0  # > 0: a slice must start on a multiple of it and end on one or at the tensor's end
    whole: bool = False  # copied only whole (packed pairs and per-row scales do not cut like square blocks)
    # an exact re-encoding of the parts instead of their bytes (FP4 -> FP8: every value kept): (parts, name, options)
    # -> stored
    recode: Callable[..., list[torch.Tensor]] | None = None


def copied_parts(parts, tags, recode: Callable[..., list[torch.Tensor]] | None = None, name: str = "",
                 options: "Options | None" = None) -> list[torch.Tensor]:
    """What a lossless copy writes, the one rule `shard` and `export` share: the stored parts (or their exact
    re-encoding) each in the dtype its spec plans. Integer codes keep their bits (a same-width view: int8 FP4 pairs
    stay pairs); a scale held in another float type is cast to the planned one."""
    from kconvert.io.dtypes import DTYPES

    out = []
    for part, tag in zip(recode(parts, name, options) if recode is not None else parts, tags):
        want = DTYPES[tag]
        out.append(part.view(want) if part.element_size() == want.itemsize and not part.is_floating_point()
                   else part.to(want))
    return out


def stored_output(x, tags, copy: LosslessCopy | None, scheme: "Scheme | None", options: "Options", kept_as_bf16: bool,
                  name: str = "") -> list:
    """What one output stores, the one rule `shard` and `export` share: a lossless copy's parts (or their exact
    re-encoding, copied_parts), else the scheme's quantized tensors (each quantizer refuses NaN/Inf, found from
    its scales), else the tensor itself (cast to bf16 where the plan says `bf16`). `tags`: the planned dtype
    tags of the output's tensors, in order."""
    if copy is not None:
        return copied_parts(x, tags, copy.recode, name, options)
    if scheme is not None:
        return scheme.quantize(x, options, name)
    if kept_as_bf16:
        import torch

        x = x.to(torch.bfloat16)
    return [x.contiguous()]


class Scheme:
    name: str = ""  # `--quant` value, kconvert.json quantization.scheme and tensors[*].transform
    shard: bool = True  # offered by `kconvert shard` (the loader and engine read it)
    experts_only: bool = False  # default policy: routed experts only (weight-only int4, as released)
    copies: tuple[str, ...] = ()  # the LosslessCopy transforms `lossless_copy` may return
    per_tensor: bool = False  # one scale for the whole tensor (nvfp4): fixed before a slice or a fused member is written

    def takes(self, info: TensorInfo) -> bool:
        return info.quantize and (info.expert is not None or not self.experts_only)

    def role(self, info: TensorInfo, family: dict) -> str | None:
        """The scheme `--quant NAME` stores this tensor in by default, by its role (None: unquantized): this one where
        it `takes` it; a scheme may give other roles another (nvfp4: the family's `[family.nvfp4]`)."""
        return self.name if self.takes(info) else None

    def option_problem(self, opts: Options) -> str | None:
        """What is wrong with `opts` for this scheme (a usage error), or None."""
        return None

    def misfit(self, shape: tuple[int, ...], opts: Options) -> str | None:
        """Why a weight of this shape cannot be stored in this scheme, or None."""
        return None

    def fits(self, shape: tuple[int, ...], opts: Options) -> bool:
        return self.misfit(shape, opts) is None

    def specs(self, src: str, shape: tuple[int, ...], opts: Options) -> list[Spec]:
        raise NotImplementedError

    def quantize(self, w: torch.Tensor, opts: Options, name: str = "") -> list[torch.Tensor]:
        raise NotImplementedError

    def dequantize(self, stored: list[torch.Tensor], opts: Options, dtype: torch.dtype | None = None) -> torch.Tensor:
        raise NotImplementedError

    def stored_bytes(self, shape: tuple[int, ...], opts: Options) -> int:
        return specs_bytes(self.specs("w", tuple(shape), opts))

    def lossless_copy(self, source: SourceQuant, opts: Options, *, same_scale_format: bool = False) -> LosslessCopy | None:
        return None

    def tensor_scale(self, x, copy: LosslessCopy | None) -> float:
        """`per_tensor` schemes: the per-tensor scale of the whole source tensor (its value, or a copy's parts)."""
        raise NotImplementedError

    def shared_scale(self, members: list[tuple[str, object, LosslessCopy | None]]) -> float:
        """`per_tensor` schemes: the one scale a fused group's members ((name, input, copy) each) share."""
        raise NotImplementedError


def sidecar(src: str) -> str:
    """DeepSeek-V4's name for the scale of weight `src` ("X.weight" -> "X.scale")."""
    return src[: -len(".weight")] + ".scale" if src.endswith(".weight") else src + ".scale"


def input_bytes(shape: tuple[int, ...], src_dtype: str) -> int:
    """Bytes of the stored source values behind a tensor (or slice) of `shape`: what a conversion
    reads for it. `I4` (compressed-tensors packed int4) and `FP4` (DeepSeek-V4's e2m1 pairs) hold two values a byte; scales are not counted."""
    n = 1
    for s in shape:
        n *= s
    return n // 2 if src_dtype in ("I4", "FP4") else n * ITEMSIZE.get(src_dtype, 2)
