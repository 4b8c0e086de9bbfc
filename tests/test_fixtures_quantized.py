"""Quantized fixture sources (tiny-k25-dsv32-fp8, tiny-k25-dsv32-int4): the stored layout and values against the bf16
fixture, and transformers loading them."""

from __future__ import annotations

import json
import re

import pytest
import torch

from fixture_files import load_in_transformers as _load, read_all


# ---------------------------------------------------------------- quantized sources
FP8_KEEP = re.compile(r"(mlp\.gate\.weight|indexer\.weights_proj\.weight|norm\.weight)$")


def test_fp8_layout_and_values(checkpoint):
    fp8 = read_all(checkpoint("tiny-k25-dsv32-fp8"))
    ref = read_all(checkpoint("tiny-k25-dsv32"))
    n_quant = 0
    for name, w in ref.items():
        is_target = w.ndim == 2 and ".model.layers." in name and not FP8_KEEP.search(name)
        if not is_target:
            assert torch.equal(fp8[name], w), name  # untouched, same bytes
            assert name[:-7] + ".weight_scale_inv" not in fp8
            continue
        n_quant += 1
        q, s = fp8[name], fp8[name[:-7] + ".weight_scale_inv"]
        assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
        rows, cols = w.shape
        assert s.shape == (-(-rows // 128), -(-cols // 128))
        scale = s.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
        deq = q.float() * scale
        err = (deq - w.float()).abs()
        # e4m3: 3 mantissa bits (relative half-ulp 2^-4), subnormal step 2^-9 (times the block scale)
        assert (err <= w.float().abs() * 2**-4 + scale * 2**-9 + 1e-12).all(), name
    # per layer: 5 MLA projections + indexer wq_b, wk; layer 0 dense MLP (3), layers 1-2: 16 experts x 3 + shared (3)
    assert n_quant == (7 + 3) + 2 * (7 + 16 * 3 + 3)
    cfg = json.loads((checkpoint("tiny-k25-dsv32-fp8") / "config.json").read_text())
    qc = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
    assert cfg["quantization_config"] == qc and cfg["text_config"]["quantization_config"] == qc


def test_fp8_loads_in_transformers(checkpoint):
    # transformers' FineGrainedFP8 quantizer needs `accelerate`; on a CPU-only machine it then
    # dequantizes to bf16 on load. Without accelerate it refuses (ImportError) before reading.
    pytest.importorskip("accelerate")
    model, info = _load("Kimi_K25ForConditionalGeneration", checkpoint("tiny-k25-dsv32-fp8"))
    assert not info["missing_keys"] and not info["unexpected_keys"]


def _unpack_nibbles(packed: torch.Tensor, cols: int) -> torch.Tensor:
    words = packed.to(torch.int64) & 0xFFFFFFFF
    nib = torch.stack([(words >> (4 * i)) & 0xF for i in range(8)], dim=-1)
    return nib.reshape(packed.shape[0], -1)[:, :cols] - 8


def test_int4_layout_and_values(checkpoint):
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    int4 = read_all(checkpoint("tiny-k25-dsv32-int4"))
    ref = read_all(checkpoint("tiny-k25-dsv32"))
    experts = [n for n in ref if re.search(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$", n)]
    assert len(experts) == 2 * 16 * 3
    for name, w in ref.items():
        if name not in experts:
            assert torch.equal(int4[name], w), name
    for name in experts:
        w, stem = ref[name].float(), name[: -len(".weight")]
        packed, scale, shape = int4[stem + ".weight_packed"], int4[stem + ".weight_scale"], int4[stem + ".weight_shape"]
        assert name not in int4
        rows, cols = w.shape
        assert packed.dtype == torch.int32 and packed.shape == (rows, cols // 8)
        assert scale.dtype == torch.bfloat16 and scale.shape == (rows, cols // 32)
        assert shape.dtype == torch.int32 and shape.tolist() == [rows, cols]
        q = _unpack_nibbles(packed, cols)
        assert torch.equal(unpack_from_int32(packed, 4, torch.Size([rows, cols])).to(torch.int64), q)
        deq = (q.float().view(rows, -1, 32) * scale.float()[..., None]).view(rows, cols)
        # half a step, plus what rounding the scale to bf16 (2^-8 relative) costs at the clamped end (+7.5 steps)
        assert ((deq - w).abs() <= scale.float().repeat_interleave(32, 1) * (0.5 + 2**-5)).all(), name
    cfg = json.loads((checkpoint("tiny-k25-dsv32-int4") / "config.json").read_text())
    for qc in (cfg["quantization_config"], cfg["text_config"]["quantization_config"]):
        assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
        weights = qc["config_groups"]["group_0"]["weights"]
        assert (weights["num_bits"], weights["type"], weights["strategy"], weights["group_size"]) == (4, "int", "group", 32)
        assert weights["symmetric"] is True and qc["config_groups"]["group_0"]["targets"] == ["Linear"]


def test_int4_loads_in_transformers(checkpoint):
    """transformers (+ compressed-tensors) loads the INT4 experts on CPU, dequantized into its fused experts."""
    from kconvert.fixtures.models.hf_build import build_model

    model, info = _load("Kimi_K25ForConditionalGeneration", checkpoint("tiny-k25-dsv32-int4"))
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ref, got = build_model("tiny-k25-dsv32").state_dict(), model.state_dict()
    for k in ref:
        if ".experts." in k:
            step = ref[k].float().abs().amax() / 7.5
            assert (got[k].float() - ref[k].float()).abs().max() <= step * 0.54, k
        else:
            assert torch.equal(ref[k].to(got[k].dtype), got[k]), k

