"""What export's two NVFP4 formats add to the others (export/formats.py asks): which scheme each tensor takes, the
per-tensor scale a fused group shares, and the quantization configs serving engines read.

- `nvfp4`: NVIDIA Model-Optimizer's layout. Routed experts NVFP4 (`X.weight` U8, `X.weight_scale` e4m3,
  `X.weight_scale_2`, `X.input_scale`), the family's other roles as its manifest's `[family.nvfp4]` says (Kimi K3:
  ModelOpt's recipe nvfp4_experts-fp8_pb_attention, block FP8 as `X.weight_scale` [R/128, 1, C/128, 1]). config.json's
  `quantization_config` is what ModelOpt's `convert_hf_quant_config_format` writes (config groups by algorithm,
  `quantized_layers`, `ignore`, `quant_algo` NVFP4 or MIXED_PRECISION, `quant_method` modelopt, or modelopt_mixed where
  SGLang and vLLM take their mixed-precision path), and `hf_quant_config.json` beside it (`producer`, `quantization`).
  In DeepSeek-V4's layout (the manifest's `export_encoding`): NVIDIA's V4 NVFP4 builds, the release's FP8
  quantization_config (`.scale` sidecars) with `quant_algo: MIXED_PRECISION`, `moe_quant_algo: NVFP4`, the drafter's
  MXFP4 experts under `ignore` (vLLM's DeepseekV4FP8Config routes the experts by `moe_quant_algo`).
- `nvfp4-ct`: compressed-tensors `nvfp4-pack-quantized` (`X.weight_packed`, `X.weight_scale`, `X.weight_global_scale`,
  `X.input_global_scale`): the routed experts; every other linear bf16 (one config group, NVFP4 weights and
  activations as its NVFP4 preset).
Module names in `quantized_layers` come with the spellings loaders probe (ModelOpt's K3 converter does the same):
the stored name, and for names under `language_model.model.` the same path under `model.` and bare.
"""

from __future__ import annotations

import threading
import weakref

from kconvert.convert.fused import fused_key
from kconvert.quant.nvfp4 import GROUP
from kconvert.quant.registry import get_scheme
from kconvert.quant.scheme import COMPRESSED_TENSORS
from kconvert.source.checkpoint import Checkpoint

PRODUCER = {"name": "kconvert"}


def role_scheme(ck: Checkpoint, encoding: str, info) -> str | None:
    """The scheme this tensor takes in an nvfp4 export (None: kept): its role's (Scheme.role); compressed-tensors'
    format takes every routed expert (a drafter's too: one config group) and nothing else."""
    if encoding == COMPRESSED_TENSORS:
        return "nvfp4" if info.expert is not None and info.quantize else None
    return get_scheme("nvfp4").role(info, ck.model.family)


class SharedScales:
    """The per-tensor scale of each member of a fused group (w1 / w3 of an expert: convert/fused.py), computed once
    per group from every member's stored parts or values, as the export's workers ask for them."""

    def __init__(self, ck: Checkpoint):
        self.ck, self.lock, self.done = ck, threading.Lock(), {}
        self.groups: dict = {}
        for name in ck.logical:
            key = fused_key(ck.info(name))
            if key is not None:
                self.groups.setdefault(key, []).append(name)

    def of(self, name: str, load) -> float | None:
        """The shared scale of `name`'s group (None: not fused). `load(member)`: (scheme, lossless copy, its input)."""
        key = fused_key(self.ck.info(name))
        if key is None or len(self.groups.get(key, ())) < 2:
            return None
        with self.lock:  # one worker computes a group; the others wait for it
            if key not in self.done:
                loaded = [(m, *load(m)) for m in self.groups[key]]  # (name, scheme, copy, input) each
                self.done[key] = loaded[0][1].shared_scale([(m, x, copy) for m, _, copy, x in loaded])
            return self.done[key]


_SHARED: "weakref.WeakKeyDictionary[Checkpoint, SharedScales]" = weakref.WeakKeyDictionary()


def shared_scales(ck: Checkpoint) -> SharedScales:
    s = _SHARED.get(ck)
    if s is None:
        s = _SHARED[ck] = SharedScales(ck)
    return s


# ------------------------------------------------------------------------------------------------ configs
def _aliases(module: str) -> list[str]:
    out = [module]
    if module.startswith("language_model.model."):
        tail = module[len("language_model.model."):]
        out += ["model." + tail, tail]
    return out


def quantized_layers(quantized: list[tuple[str, str]]) -> dict[str, dict]:
    """{module (every spelling): {"quant_algo", ...}} of (weight name, scheme) pairs; an expert bank
    (`...experts`) once for its experts, as vLLM's fused MoE looks it up."""
    out: dict[str, dict] = {}
    for weight, scheme in quantized:
        module = weight[: -len(".weight")]
        cfg = {"quant_algo": "NVFP4", "group_size": GROUP} if scheme == "nvfp4" else \
            {"quant_algo": "FP8_PB_WO"} if scheme == "fp8" else {"quant_algo": "W4A16_MXFP4"}
        names = [module] + ([module.rsplit(".experts.", 1)[0] + ".experts"] if ".experts." in module else [])
        for n in names:
            for alias in _aliases(n):
                out[alias] = cfg
    return dict(sorted(out.items()))


def modelopt_configs(quantized: list[tuple[str, str]], ignore: list[str]) -> tuple[dict, dict]:
    """(config.json's quantization_config, hf_quant_config.json) of a ModelOpt-layout export."""
    layers = quantized_layers(quantized)
    mixed = len({c["quant_algo"] for c in layers.values()}) > 1
    algo = "MIXED_PRECISION" if mixed else "NVFP4"
    groups: dict[str, dict] = {}
    by_algo: dict[str, list[str]] = {}
    for module, cfg in layers.items():
        by_algo.setdefault(cfg["quant_algo"], []).append(module)
    for i, (a, modules) in enumerate(by_algo.items()):
        nv = a == "NVFP4"
        weights = {"dynamic": False, "num_bits": 4 if nv else 8, "type": "float", **({"group_size": GROUP} if nv else {})}
        acts = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": GROUP} if nv else None
        groups[f"group_{i}"] = {"weights": weights, **({"input_activations": acts} if acts else {}),
                                "targets": modules if mixed else ["Linear"]}
    qc = {"config_groups": groups, **({"quantized_layers": layers} if mixed else {}), "ignore": ignore,
          "quant_algo": algo, "kv_cache_scheme": None, "producer": PRODUCER,
          "quant_method": "modelopt_mixed" if mixed else "modelopt"}
    if not mixed:
        qc["group_size"] = GROUP
    return qc, hf_quant_config(qc)


def hf_quant_config(qc: dict) -> dict:
    """hf_quant_config.json (ModelOpt's own record, which older loaders read) of a ModelOpt quantization_config."""
    q = {"quant_algo": qc["quant_algo"], "kv_cache_quant_algo": None, "group_size": GROUP, "exclude_modules": qc["ignore"]}
    if "quantized_layers" in qc:
        q["quantized_layers"] = qc["quantized_layers"]
    return {"producer": qc["producer"], "quantization": q}


def deepseek_v4_config(fp8_qc: dict, quantized: list[tuple[str, str]]) -> dict:
    """NVIDIA's DeepSeek-V4 NVFP4 builds' quantization_config: the release's FP8 one, NVFP4 routed experts declared,
    the drafter stages' MXFP4 experts ignored."""
    banks = [w for w, s in quantized if s == "nvfp4"]
    drafter = sorted({w.split(".", 2)[0] + "." + w.split(".", 2)[1] + ".*" for w, s in quantized
                      if s == "fp4" and w.startswith("mtp.")})
    layers = {m: c for m, c in quantized_layers([(w, "nvfp4") for w in banks]).items() if m.endswith(".experts")}
    return {**fp8_qc, "quant_algo": "MIXED_PRECISION", "moe_quant_algo": "NVFP4", "group_size": GROUP,
            "producer": PRODUCER, "ignore": drafter or ["mtp.*"], "quantized_layers": layers}


def compressed_tensors_config(ignore: list[str]) -> dict:
    """compressed-tensors `nvfp4-pack-quantized`: its NVFP4 preset (weights and activations, 16 per e4m3 scale, one
    float32 global scale) on every Linear not ignored."""
    args = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": GROUP,
            "block_structure": None, "actorder": None, "observer": "minmax", "observer_kwargs": {},
            "scale_dtype": "torch.float8_e4m3fn", "zp_dtype": "torch.float8_e4m3fn"}
    return {"quant_method": "compressed-tensors", "quantization_status": "compressed", "kv_cache_scheme": None,
            "format": "nvfp4-pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {**args, "dynamic": False},
                                          "input_activations": {**args, "dynamic": "local", "observer": "static_minmax"},
                                          "output_activations": None, "format": "nvfp4-pack-quantized"}},
            "ignore": ignore}
