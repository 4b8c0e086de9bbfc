"""`kconvert export` of DeepSeek-V4 and of Kimi over V4 text. fp8-block is V4's own layout (`X.weight` e4m3 +
`X.scale`), its scales in the dtype vLLM reads for the `expert_dtype` written: exporting the release (FP4 experts kept
as int8 code pairs, e8m0 scales, `expert_dtype: fp4`) reproduces it tensor for tensor, byte for byte; a bf16 source
becomes FP8 experts with float32 scales holding powers of two (`expert_dtype: fp8`, V4-Flash-Base's layout; never
e8m0 beside fp8: tests/families/dsv4/test_dsv4_vllm_scales.py); w4a16 is compressed-tensors. Every export is read back by
inspect's reader and converted again by shard."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import cli_here, load_source
from kconvert.source.checkpoint import Checkpoint


def export(src, out, fmt):
    r = cli_here("export", src, out, "--format", fmt)
    assert r.returncode == 0, r.stderr
    return out


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.element_size() == 1 else torch.equal(a, b)


def test_the_release_exported_as_fp8_block_is_the_release(checkpoint, tmp_path):
    src = checkpoint("tiny-dsv4-flash")
    out = export(src, tmp_path / "fp8", "fp8-block")
    want, got = load_source(src), load_source(out)
    assert set(want) == set(got)
    assert [k for k in want if not same_bytes(want[k], got[k])] == []
    cfg, release = json.loads((out / "config.json").read_text()), json.loads((src / "config.json").read_text())
    assert cfg["expert_dtype"] == "fp4" and cfg["quantization_config"] == release["quantization_config"]


def test_bf16_v4_as_fp8_block_and_w4a16_read_back_and_reshard(checkpoint, tmp_path):
    src = checkpoint("tiny-dsv4")
    ref = Checkpoint.open(src)
    fp8 = export(src, tmp_path / "fp8", "fp8-block")
    raw = load_source(fp8)
    name = "layers.2.ffn.experts.5.w3.weight"
    scales = {n: t for n, t in raw.items() if n.endswith(".scale")}
    assert raw[name].dtype == torch.float8_e4m3fn and {t.dtype for t in scales.values()} == {torch.float32}
    assert all(torch.equal(t.log2().round().exp2(), t) for t in scales.values())  # V4's powers of two, as float32
    config = json.loads((fp8 / "config.json").read_text())
    assert config["expert_dtype"] == "fp8" and "scale_fmt" not in config["quantization_config"]
    back = Checkpoint.open(fp8)
    for n in (name, "layers.1.attn.wq_b.weight"):
        w, x = back.read(n).float(), ref.read(n).float()
        assert back.logical[n].format == "block_fp8"
        assert (w - x).abs().max() <= x.abs().max() / 8, n  # e4m3 with power-of-two block scales
    w4 = export(checkpoint("tiny-dsv4-flash"), tmp_path / "w4", "w4a16")
    assert Checkpoint.open(w4).logical["layers.0.ffn.experts.1.w2.weight"].format == "int4_packed"
    for exported in (fp8, w4):
        r = cli_here("shard", exported, tmp_path / (exported.name + "-tp2"), "--tp", 2)
        assert r.returncode == 0, r.stderr


def test_kimi_over_v4_fp8_block_keeps_vision_and_names_its_text_experts(checkpoint, tmp_path):
    out = export(checkpoint("tiny-k25-dsv4"), tmp_path / "fp8", "fp8-block")
    raw = load_source(out)
    assert raw["language_model.model.layers.0.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert raw["language_model.model.layers.0.attn.wq_a.scale"].dtype == torch.float32  # beside expert_dtype fp8
    assert raw["vision_tower.encoder.blocks.0.wqkv.weight"].dtype == torch.bfloat16  # text_only, as released
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["text_config"]["expert_dtype"] == "fp8"
    Checkpoint.open(out).validate()


def test_flash_base_exported_as_fp8_block_is_the_release(checkpoint, tmp_path):
    """V4-Flash-Base's layout (FP8 experts, float32 `.scale`) is its own export: every FP8 block and its float32 scale
    copied byte for byte, `expert_dtype: fp8` and no `scale_fmt` (its scales are not e8m0)."""
    src = checkpoint("tiny-dsv4-flash-base")
    out = export(src, tmp_path / "fp8", "fp8-block")
    want, got = load_source(src), load_source(out)
    assert set(want) == set(got) and [k for k in want if not same_bytes(want[k], got[k])] == []
    cfg, release = json.loads((out / "config.json").read_text()), json.loads((src / "config.json").read_text())
    assert cfg["expert_dtype"] == "fp8" and cfg["quantization_config"] == release["quantization_config"]


def test_fp32_scales_beside_fp4_experts_are_refused(checkpoint, tmp_path):
    """FP4 experts make `expert_dtype: fp4`, whose FP8 scales vLLM reads as e8m0 bytes: float32 ones cannot be asked."""
    r = cli_here("export", checkpoint("tiny-dsv4-flash"), tmp_path / "fp8", "--format", "fp8-block",
                 "--scale-format", "fp32")
    assert r.returncode == 2 and "expert_dtype fp4" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "fp8" / "model.safetensors.index.json").exists()
