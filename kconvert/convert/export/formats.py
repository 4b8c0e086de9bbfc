"""The formats `kconvert export` writes. Each is a scheme of kconvert/quant/registry.py stored under a
serving engine's names and packing, plus the `quantization_config` those engines read; none has a
quantizer of its own. Formulas: docs/EXPORT.md.

- fp8-block:   the `fp8` scheme (DeepSeek-V3/V3.2 and Kimi FP8 releases: `X.weight` e4m3 +
               `X.weight_scale_inv` float32 per 128x128 block); text-layer linears only (router, indexer
               weights_proj, norms, embeddings, lm_head and the vision tower stay bf16, as the releases).
- w4a16:       the `int4` scheme in the compressed-tensors encoding (pack-quantized int32 words, its
               min-max rule, bf16 scales; Kimi-K2-Thinking / K2.5): routed experts only.
- w8a8-int8:   the `int8` scheme (compressed-tensors int-quantized, dynamic per-token activations).
- fp8-channel: the `fp8_channel` scheme (compressed-tensors float-quantized, the same with e4m3).
- bf16:        no scheme: every quantized tensor (FP8, MXFP4, INT4, FP8 rows) dequantized and stored BF16, every
               other tensor as stored, under the release's names; no quantization_config (fine-tuning, and the
               export vLLM's CPU backend runs). Exact where BF16 holds the values (FP4 and FP8 with power-of-two
               scales: V4, V4.1, K3), else rounded to nearest (ExportFigures.rounded counts those tensors).
- nvfp4:       the `nvfp4` scheme in NVIDIA Model-Optimizer's layout (routed experts; the family's other roles as its
               manifest's [family.nvfp4] says), or DeepSeek-V4's (NVIDIA's V4 NVFP4 builds): export/nvfp4_layout.py.
- nvfp4-ct:    the `nvfp4` scheme in compressed-tensors' nvfp4-pack-quantized (routed experts).
Transforms of one logical tensor: copy (kept as stored), bf16 (dequantized, kept high precision), the
format's transform (below), or the scheme's lossless copy (fp8_copy, int4_copy).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from kconvert.errors import UsageError
from kconvert.family.manifest import TensorInfo
from kconvert.io.dtypes import FP8_BLOCK, specs_bytes
from kconvert.source.checkpoint import Checkpoint
from kconvert.source.formats import LogicalTensor
from kconvert.source.stored_parts import read_parts
from kconvert.quant.policy import selected
from kconvert.source.stored_quant import rows_copy, source_fp8_block, source_quant
from kconvert.quant.registry import get_scheme
from kconvert.quant.scheme import (COMPRESSED_TENSORS, KCONVERT, V4_ENCODINGS, LosslessCopy, Options, Scheme, input_bytes,
                                  stored_output)
from kconvert.convert.export import expert_dtype as v4_layout
from kconvert.convert.export import nvfp4_layout
from kconvert.convert.export.table import EXPORT_FORMATS




@dataclass(frozen=True)
class Exported:
    """One logical source tensor and the 1-3 tensors it becomes in the export."""

    src: str
    transform: str
    shape: tuple[int, ...]
    src_dtype: str  # stored dtype tag of the source (I4 for packed int4)
    group: int = 32
    copy_tags: tuple[str, ...] = ()  # int4_copy: the source's scale and weight_shape dtypes
    scheme_name: str = ""  # quantized or copied: the registry's scheme; "" when kept unquantized
    encoding: str = KCONVERT
    scale_fmt: str = "fp32"
    copy: LosslessCopy | None = None  # a lossless copy: the source parts written unchanged or re-encoded exactly
    fp8_block: int = FP8_BLOCK  # fp8-block: a block-FP8 source's own square block (DeepSeek-V4.1's 32), else 128

    @property
    def scheme(self) -> Scheme | None:
        return get_scheme(self.scheme_name) if self.scheme_name else None

    @property
    def options(self) -> Options:
        return Options(self.scale_fmt, self.group, "amax", self.encoding, fp8_block=self.fp8_block)

    def specs(self) -> list[tuple[str, str, tuple[int, ...]]]:
        scheme = self.scheme
        if scheme is None:
            return [(self.src, self.src_dtype if self.transform == "copy" else "BF16", self.shape)]
        specs = scheme.specs(self.src, self.shape, self.options)
        if self.copy_tags:  # a copied int4 source keeps its scale and weight_shape dtypes
            specs = [specs[0]] + [(n, tag, s) for (n, _, s), tag in zip(specs[1:], self.copy_tags)]
        return specs

    @property
    def bytes_out(self) -> int:
        return specs_bytes(self.specs())

    @property
    def bytes_in(self) -> int:
        return input_bytes(self.shape, self.src_dtype)


def quantizes(fmt: str, info: TensorInfo, shape: tuple[int, ...], group: int) -> bool:
    """The scheme's default policy (no --keep / --quantize here), for `.weight` linears the format can store."""
    f = EXPORT_FORMATS[fmt]
    if not f.scheme:
        return False
    scheme = get_scheme(f.scheme)
    if len(shape) != 2 or not info.name.endswith(".weight") or (f.text_only and info.group != "text"):
        return False
    return selected(scheme, info, shape) and scheme.fits(shape, Options(group_size=group, encoding=f.encoding))


def plan_tensor(ck: Checkpoint, fmt: str, name: str, t: LogicalTensor, group: int, scale_fmt: str,
                experts: str | None = None) -> Exported:
    """How tensor `name` is exported. `experts`: the `expert_dtype` a DeepSeek-V4-layout export writes (v4_layout.py),
    which decides its routed experts' format and every FP8 scale's dtype; None for other layouts."""
    info = ck.info(name)
    shape = tuple(t.shape)
    encoding = v4_layout.encoding(ck, fmt, experts)
    if info.rule.scale_block is not None and t.format != "plain" and encoding in V4_ENCODINGS:
        # the release's FP8 rows (V4.1's Engram tables), copied in its own layout
        return Exported(name, "fp8_rows", shape, t.stored_dtype, group, (), "fp8_rows", encoding, "ue8m0", rows_copy(ck, t))
    f = EXPORT_FORMATS[fmt]
    scheme_name, transform = f.scheme, f.transform
    block = source_fp8_block(ck.quantization_config)  # a 32 x 32 source keeps its blocks (copied, not re-blocked)
    opts = Options(scale_fmt, group, "amax", encoding, fp8_block=block)
    if f.scheme == "nvfp4":  # each tensor by its role (export/nvfp4_layout.py)
        if experts == "fp8":
            raise UsageError("--format nvfp4 in DeepSeek-V4's layout is read beside `expert_dtype: fp4` (NVIDIA's V4 "
                             "NVFP4 builds); this source stores no FP4 experts: export from an FP4 release",
                             file=str(ck.root / "config.json"))
        scheme_name = nvfp4_layout.role_scheme(ck, encoding, info) \
            if len(shape) == 2 and info.name.endswith(".weight") else None
        if scheme_name is not None and get_scheme(scheme_name).misfit(shape, opts):
            scheme_name = None  # a width the scheme cannot store: kept, as the other formats keep it
        transform = scheme_name
    if scheme_name is None or (f.scheme != "nvfp4" and not quantizes(fmt, info, shape, group)):
        return Exported(name, "copy" if t.format == "plain" else "bf16", shape, t.stored_dtype)
    if experts == "fp4" and f.scheme != "nvfp4" and (info.expert is not None or t.format == "fp4_packed"):
        # one expert format, as vLLM reads one expert_dtype: the release's FP4 experts byte for byte, others to FP4
        scheme_name, transform = "fp4", "fp4"
        why = get_scheme("fp4").misfit(shape, opts)
        if why and t.format != "fp4_packed":
            raise UsageError(f"{why}: DeepSeek-V4's layout with FP4 routed experts (expert_dtype fp4) stores every "
                             "routed expert in FP4", tensor=name)
    copy = get_scheme(scheme_name).lossless_copy(source_quant(ck, t, info), opts, same_scale_format=True)
    if copy is None:
        return Exported(name, transform, shape, t.stored_dtype, group, (), scheme_name, encoding, scale_fmt, None, block)
    # a copied pack-quantized source keeps the dtypes it stores its scale and weight_shape in
    tags = tuple(t.parts[role].dtype for role in copy.roles[1:]) \
        if f.encoding == COMPRESSED_TENSORS and scheme_name == "int4" else ()
    return Exported(name, copy.transform, shape, t.stored_dtype, group, tags, scheme_name, encoding, scale_fmt, copy,
                    block)


class _Scaled(NamedTuple):
    """A weight's input together with the per-tensor scale its fused group shares (nvfp4's w1 / w3)."""

    x: object
    scale: float


def _input(ck: Checkpoint, name: str, copy: LosslessCopy | None):
    t = ck.logical[name]
    if copy is not None:
        return read_parts(t, copy.roles)  # checked as shard checks its copies (NaN/Inf, INT4 weight_shape)
    return ck.read(name)


def load(ck: Checkpoint, e: Exported):
    """What `produce` needs: raw stored parts for the bit-exact copies, else the (dequantized) weight; with the scale
    of its fused group where the scheme keeps one per tensor (convert/fused.py)."""
    x = _input(ck, e.src, e.copy)
    if e.scheme is not None and e.scheme.per_tensor:
        scale = nvfp4_layout.shared_scales(ck).of(e.src, lambda m: (e.scheme, e.copy, _input(ck, m, e.copy)))
        if scale is not None:
            return _Scaled(x, scale)
    return x


def produce(e: Exported, x) -> list[torch.Tensor]:
    """The tensors of `e.specs()`, in that order (as shard writes them: quant.scheme.stored_output)."""
    opts = e.options
    if isinstance(x, _Scaled):
        x, opts = x.x, replace(opts, tensor_scale=x.scale)
    return stored_output(x, [tag for _, tag, _ in e.specs()], e.copy, e.scheme, opts, e.transform == "bf16", e.src)


def exact_in_bf16(x: torch.Tensor, written: torch.Tensor) -> bool:
    """Whether the BF16 tensor written for dequantized values `x` holds them exactly."""
    return torch.equal(written.to(torch.float32), x.to(torch.float32))


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
    m = re.search(r"(?:layers|mtp)\.\d+\.(.*)$", module)  # decoder layers and MTP blocks alike
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


def quantization_config(fmt: str, group: int, scale_fmt: str, ignore: list[str], fp8_block: int = FP8_BLOCK,
                        quantized: list[tuple[str, str]] | None = None, encoding: str | None = None) -> dict | None:
    """config.json's quantization_config; None for an unquantized format (bf16). nvfp4 formats (export/nvfp4_layout.py)
    need `quantized`: (weight name, scheme) of every tensor stored quantized, and the export's `encoding` (DeepSeek-V4's
    layout or not)."""
    if not EXPORT_FORMATS[fmt].scheme:
        return None
    if fmt == "nvfp4" and encoding in V4_ENCODINGS:
        return nvfp4_layout.deepseek_v4_config(quantization_config("fp8-block", group, scale_fmt, ignore, fp8_block),
                                               quantized or [])
    if fmt == "nvfp4":
        return nvfp4_layout.modelopt_configs(quantized or [], ignore)[0]
    if fmt == "nvfp4-ct":
        return nvfp4_layout.compressed_tensors_config(ignore)
    if fmt == "fp8-block":
        qc = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
              "weight_block_size": [fp8_block, fp8_block]}
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


def side_configs(fmt: str, qc: dict) -> dict[str, dict]:
    """The files an export writes beside config.json for its format: ModelOpt's hf_quant_config.json (nvfp4 in
    Model-Optimizer's own layout)."""
    if fmt != "nvfp4" or qc.get("quant_method") not in ("modelopt", "modelopt_mixed"):
        return {}
    return {"hf_quant_config.json": nvfp4_layout.hf_quant_config(qc)}
