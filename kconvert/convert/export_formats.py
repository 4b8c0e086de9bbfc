"""The formats `kconvert export` writes: which tensors each quantizes, the tensors each becomes, and the
`quantization_config` serving engines read. Formulas: docs/EXPORT.md.

- fp8-block:  DeepSeek-V3/V3.2 and Kimi FP8 releases. `X.weight` e4m3 + `X.weight_scale_inv` float32 per
              128x128 block; text-layer linears only (router, indexer weights_proj, norms, embeddings,
              lm_head and the vision tower stay bf16, as the releases keep them).
- w4a16:      compressed-tensors pack-quantized int4 (Kimi-K2-Thinking / K2.5): routed experts only.
- w8a8-int8:  compressed-tensors int-quantized, per-channel weight scale, dynamic per-token activations.
- fp8-channel: compressed-tensors float-quantized, the same with e4m3.
Transforms of one logical tensor: copy (kept as stored), bf16 (dequantized, kept high precision),
fp8_block, fp8_copy (block-FP8 source copied bit for bit), int4, int4_copy, int8_channel, fp8_channel.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from kconvert.errors import UsageError
from kconvert.family.manifest import TensorInfo
from kconvert.io.dtypes import FP8_BLOCK, ITEMSIZE, specs_bytes
from kconvert.io.safetensors_read import read_tensor
from kconvert.source.checkpoint import Checkpoint
from kconvert.source.formats import LogicalTensor
from kconvert.convert.int4_pack import quantize_int4_packed
from kconvert.convert.quantize import quantize_fp8_block, quantize_fp8_channel, quantize_int8_channel

FORMATS = ("fp8-block", "w4a16", "w8a8-int8", "fp8-channel")
FORMAT_TRANSFORM = {"fp8-block": "fp8_block", "w4a16": "int4", "w8a8-int8": "int8_channel",
                    "fp8-channel": "fp8_channel"}


@dataclass(frozen=True)
class Exported:
    """One logical source tensor and the 1-3 tensors it becomes in the export."""

    src: str
    transform: str
    shape: tuple[int, ...]
    src_dtype: str  # stored dtype tag of the source (I4 for packed int4)
    group: int = 32
    copy_tags: tuple[str, ...] = ()  # int4_copy: the source's scale and weight_shape dtypes

    def specs(self) -> list[tuple[str, str, tuple[int, ...]]]:
        r, c = (self.shape + (0, 0))[:2]
        base = self.src[: -len(".weight")]
        if self.transform in ("fp8_block", "fp8_copy"):
            return [(self.src, "F8_E4M3", self.shape), (base + ".weight_scale_inv", "F32", (-(-r // FP8_BLOCK), -(-c // FP8_BLOCK)))]
        if self.transform in ("int4", "int4_copy"):
            scale_tag, shape_tag = self.copy_tags or ("BF16", "I32")
            return [(base + ".weight_packed", "I32", (r, c // 8)), (base + ".weight_scale", scale_tag, (r, c // self.group)),
                    (base + ".weight_shape", shape_tag, (2,))]
        if self.transform in ("int8_channel", "fp8_channel"):
            tag = "I8" if self.transform == "int8_channel" else "F8_E4M3"
            return [(self.src, tag, self.shape), (base + ".weight_scale", "F32", (r, 1))]
        return [(self.src, self.src_dtype if self.transform == "copy" else "BF16", self.shape)]

    @property
    def bytes_out(self) -> int:
        return specs_bytes(self.specs())

    @property
    def bytes_in(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n // 2 if self.src_dtype == "I4" else n * ITEMSIZE.get(self.src_dtype, 2)


def quantizes(fmt: str, info: TensorInfo, shape: tuple[int, ...], group: int) -> bool:
    if len(shape) != 2 or not info.name.endswith(".weight"):
        return False
    if fmt == "w4a16":
        return info.component == "routed_experts" and shape[1] % group == 0
    if fmt == "fp8-block":
        return info.quantize and info.group == "text"
    return info.quantize


def plan_tensor(ck: Checkpoint, fmt: str, name: str, t: LogicalTensor, group: int, scale_fmt: str) -> Exported:
    info = ck.info(name)
    if not quantizes(fmt, info, tuple(t.shape), group):
        return Exported(name, "copy" if t.format == "plain" else "bf16", tuple(t.shape), t.stored_dtype)
    transform = FORMAT_TRANSFORM[fmt]
    if (fmt == "fp8-block" and t.format == "block_fp8" and ck.quant_block() == (FP8_BLOCK, FP8_BLOCK)
            and source_scale_fmt(ck) == scale_fmt):
        transform = "fp8_copy"
    tags: tuple[str, ...] = ()
    if fmt == "w4a16" and t.format == "int4_packed" and ck.int4_group() == group:
        transform, tags = "int4_copy", (t.parts["scale"].dtype, t.parts["shape"].dtype)
    return Exported(name, transform, tuple(t.shape), t.stored_dtype, group, tags)


def source_scale_fmt(ck: Checkpoint) -> str:
    return "ue8m0" if ck.quantization_config.get("scale_fmt") == "ue8m0" else "fp32"


def load(ck: Checkpoint, e: Exported):
    """What `produce` needs: raw stored parts for the bit-exact copies, else the (dequantized) weight."""
    t = ck.logical[e.src]
    if e.transform == "fp8_copy":
        return read_tensor(t.parts["weight"]), read_tensor(t.parts["scale"])
    if e.transform == "int4_copy":
        return read_tensor(t.parts["packed"]), read_tensor(t.parts["scale"]), read_tensor(t.parts["shape"])
    return ck.read(e.src)


def produce(e: Exported, x, scale_fmt: str = "fp32") -> list[torch.Tensor]:
    """The tensors of `e.specs()`, in that order."""
    if e.transform in ("fp8_copy", "int4_copy"):
        return list(x)
    if e.transform in ("copy", "bf16"):
        return [(x.to(torch.bfloat16) if e.transform == "bf16" else x).contiguous()]
    # each quantizer refuses NaN/Inf (found from its scales, no extra pass)
    if e.transform == "fp8_block":
        return list(quantize_fp8_block(x, FP8_BLOCK, scale_fmt, e.src))
    if e.transform == "int4":
        packed, scale = quantize_int4_packed(x, e.group, e.src)
        return [packed, scale, torch.tensor(list(e.shape), dtype=torch.int32)]
    if e.transform == "int8_channel":
        return list(quantize_int8_channel(x, e.src))
    return list(quantize_fp8_channel(x, e.src))


# --------------------------------------------------------------------------- config.json

_FUSED = ((re.compile(r"\b(gate|up)_proj$"), "(gate|up|gate_up)_proj"),
          (re.compile(r"\b(q_a_proj|kv_a_proj_with_mqa)$"), "(q_a_proj|kv_a_proj_with_mqa|fused_qkv_a_proj)"))


def ignore_pattern(info: TensorInfo) -> str:
    """A compressed-tensors `ignore` entry for a linear kept unquantized. Unanchored at the start, so it
    matches both the published names and transformers' (`model.language_model.…`); fused siblings
    (gate/up, q_a/kv_a) share one entry, as vLLM and SGLang check every part of a fused layer."""
    module = info.name[: -len(".weight")]
    if info.group != "text":
        return r"re:.*" + re.escape(module.split(".")[0]) + r"\..*"
    m = re.search(r"layers\.\d+\.(.*)$", module)
    tail = re.escape(m.group(1) if m else module.split(".")[-1])
    tail = re.sub(r"\\\.\d+\\\.", r"\\.\\d+\\.", tail)
    for rx, fused in _FUSED:
        tail = rx.sub(fused, tail)
    return rf"re:.*{tail}$"


def ignore_list(kept: list[TensorInfo], quantized: list[TensorInfo]) -> list[str]:
    pats = sorted({ignore_pattern(i) for i in kept})
    for i in quantized:
        module = i.name[: -len(".weight")]
        hit = next((p for p in pats if re.fullmatch(p[3:], module)), None)
        if hit:  # a kept and a quantized linear that one rule cannot tell apart: name the kept ones exactly
            raise UsageError(f"ignore rule {hit} would also exclude {module}, which this format quantizes")
    return pats


def quantization_config(fmt: str, group: int, scale_fmt: str, ignore: list[str]) -> dict:
    if fmt == "fp8-block":
        qc = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
              "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
        if scale_fmt == "ue8m0":
            qc["scale_fmt"] = "ue8m0"
        return qc
    kind = "float" if fmt == "fp8-channel" else "int"
    bits = 4 if fmt == "w4a16" else 8
    weights = {"num_bits": bits, "type": kind, "symmetric": True, "dynamic": False, "actorder": None,
               "block_structure": None, "observer": "minmax", "observer_kwargs": {},
               "strategy": "group" if fmt == "w4a16" else "channel", "group_size": group if fmt == "w4a16" else None}
    acts = None if fmt == "w4a16" else {"num_bits": 8, "type": kind, "symmetric": True, "dynamic": True,
                                        "strategy": "token", "group_size": None, "block_structure": None,
                                        "actorder": None, "observer": None, "observer_kwargs": {}}
    return {"quant_method": "compressed-tensors", "quantization_status": "compressed", "kv_cache_scheme": None,
            "format": {"w4a16": "pack-quantized", "w8a8-int8": "int-quantized", "fp8-channel": "float-quantized"}[fmt],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                                          "output_activations": None}},
            "ignore": ignore}
