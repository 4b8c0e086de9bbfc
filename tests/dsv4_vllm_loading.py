"""An emulation of how vLLM loads a DeepSeek-V4-layout FP8 checkpoint's weights and block scales (vLLM itself is not
installed here: this follows its source, read for docs/EXPORT.md "Scale dtypes as each consumer reads them"), for the
tests that check an export is read by vLLM as kconvert means it. Not kconvert code: nothing in kconvert/ imports it.

What it follows (vllm-project/vllm):
- `vllm/models/deepseek_v4/quant_config.py` DeepseekV4FP8Config: `expert_dtype` from the hf_config, "fp4" when absent
  (L96); `is_scale_e8m0` is `expert_dtype == "fp4"` (L110-114): the FP8 linears' block scale parameters are
  float8_e8m0fnu for "fp4", float32 for "fp8"; routed experts are Mxfp4MoEMethod for "fp4" (raw uint8 exponents),
  Fp8MoEMethod with float32 block scales for "fp8".
- `vllm/models/deepseek_v4/nvidia/model.py` `_make_deepseek_v4_weights_mapper`: "fp4" renames a routed expert's
  `.scale` to `weight_scale`, every other `.scale` to `weight_scale_inv`; "fp8" every `.scale` to `weight_scale_inv`.
  `DeepseekV4Model.load_weights`: a name with ".experts." and "weight_scale" whose tensor is float8_e8m0fnu is viewed
  as uint8 before the parameter's loader copies it (so into a float32 parameter each byte lands as a number: 2^-12,
  byte 115, loads as 115.0); every other tensor is copied into its parameter, a value conversion.
- `vllm/transformers_utils/configs/deepseek_v41.py`: a composite config's text_config keys become attributes, the top
  level's then override them, and `quantization_config["expert_dtype"]` is taken when neither has one (L34-50).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file

ROUTED_EXPERT = re.compile(r"\.experts\.\d+\.w[123]\.")  # `.shared_experts.` has no dot before `experts`
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def vllm_expert_dtype(config: dict) -> str:
    """`hf_config.expert_dtype` as vLLM's V4 / V4.1 config classes leave it (default "fp4")."""
    flat = dict(config.get("text_config") or {})
    flat.update({k: v for k, v in config.items() if k != "text_config"})
    if "expert_dtype" not in flat:
        flat["expert_dtype"] = (config.get("quantization_config") or {}).get("expert_dtype", "fp4")
    return flat["expert_dtype"]


def vllm_scale_param(name: str, loaded: torch.Tensor, expert_dtype: str) -> torch.Tensor:
    """The scale parameter vLLM holds after loading checkpoint tensor `name` (a `.scale`), as float32 values."""
    routed = bool(ROUTED_EXPERT.search(name))
    if routed and loaded.dtype == torch.float8_e8m0fnu:
        loaded = loaded.view(torch.uint8)  # load_weights: "keep the raw exponent bytes" for the MoE parameter
    if routed and expert_dtype == "fp4":  # Mxfp4MoEMethod: uint8 exponents, 2^(byte - 127)
        return torch.exp2(loaded.to(torch.uint8).to(torch.float32) - 127)
    param_dtype = torch.float8_e8m0fnu if expert_dtype == "fp4" else torch.float32  # is_scale_e8m0
    return loaded.to(param_dtype).to(torch.float32)  # the parameter's copy_: a value conversion


def vllm_dequantized(export: Path) -> dict[str, torch.Tensor]:
    """Every FP8 / FP4 weight of a DeepSeek-V4-layout export, dequantized from the parameters vLLM loads it into:
    {weight name: float32 [out, in]}. A weight whose stored form does not fit the parameter vLLM builds for it (FP4
    code pairs where "fp8" makes FP8 experts, or the reverse) raises, as vLLM's loader fails on it."""
    config = json.loads((export / "config.json").read_text())
    expert_dtype = vllm_expert_dtype(config)
    block = ((config.get("quantization_config") or {}).get("weight_block_size") or [128, 128])[0]
    tensors = {}
    for f in sorted(export.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    out = {}
    for name, scale in tensors.items():
        if not name.endswith(".scale"):
            continue
        wname = name[: -len(".scale")] + ".weight"
        w = tensors[wname]
        if w.dtype == torch.float8_e4m3fn and scale.shape[1] * 32 == w.shape[1] and scale.shape[0] == w.shape[0]:
            continue  # FP8 rows (V4.1's Engram tables): their own loader keeps the bytes, whatever expert_dtype
        s = vllm_scale_param(name, scale, expert_dtype)
        if ROUTED_EXPERT.search(name) and expert_dtype == "fp4":
            if w.dtype not in (torch.int8, torch.uint8):
                raise ValueError(f"{wname}: {w.dtype} where expert_dtype fp4 builds MXFP4 code pairs")
            codes = w.view(torch.uint8)
            pairs = torch.stack([codes & 0xF, codes >> 4], dim=-1).flatten(-2).long()  # low nibble: the even column
            out[wname] = E2M1[pairs] * s.repeat_interleave(32, dim=1)
            continue
        if w.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{wname}: {w.dtype} where expert_dtype {expert_dtype} builds an FP8 parameter")
        rows, cols = w.shape
        out[wname] = w.to(torch.float32) * s.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    return out
