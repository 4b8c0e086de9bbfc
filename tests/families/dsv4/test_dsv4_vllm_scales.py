"""DeepSeek-V4-layout `fp8-block` exports read the way vLLM reads them (tests/dsv4_vllm_loading.py: an emulation of its
loader, since vLLM is not installed here: the scale parameters' dtype chosen from `expert_dtype`, e8m0 routed-expert
scale bytes kept raw): every FP8 and FP4 weight vLLM would compute equals kconvert's dequantization of the same export.
An export with e8m0 `.scale` tensors beside `expert_dtype: fp8` (what kconvert wrote for a BF16 V4 source until
2026-12) loads in vLLM with every routed expert's scale byte taken as a number (2^-12 as 115.0): it fails here."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import cli_here
from kconvert.source.checkpoint import Checkpoint
from dsv4_vllm_loading import E2M1, ROUTED_EXPERT, vllm_dequantized


def export(src, out):
    r = cli_here("export", src, out, "--format", "fp8-block")
    assert r.returncode == 0, r.stderr
    return out


def with_bf16_experts(src, dst):
    """`src` with its FP4 routed experts stored as the exact BF16 of their values (a dequantized release: its FP8
    linears keep their e8m0 `.scale`, its config its `expert_dtype: fp4`)."""
    shutil.copytree(src, dst)
    index_path = dst / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    files = {f.name: load_file(str(f)) for f in sorted(dst.glob("*.safetensors"))}
    stored = {n: t for tensors in files.values() for n, t in tensors.items()}
    for name in [n for n, t in stored.items() if ROUTED_EXPERT.search(n) and t.dtype == torch.int8]:
        scale_name = name[: -len(".weight")] + ".scale"
        codes, scale = stored[name].view(torch.uint8), stored[scale_name].view(torch.uint8)
        values = E2M1[torch.stack([codes & 0xF, codes >> 4], -1).flatten(-2).long()]
        files[index["weight_map"][name]][name] = (values * torch.exp2(scale.float() - 127).repeat_interleave(32, 1)
                                                  ).to(torch.bfloat16)
        del files[index["weight_map"].pop(scale_name)][scale_name]
    for fname, tensors in files.items():
        save_file(tensors, str(dst / fname), metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))
    return dst


@pytest.mark.parametrize("preset,bf16_experts,experts", [
    ("tiny-dsv4", False, "fp8"),  # BF16 source: FP8 experts, float32 scales (the bug: e8m0 beside fp8)
    ("tiny-dsv4-flash", False, "fp4"),  # the release: FP4 experts, e8m0 scales, byte for byte
    ("tiny-dsv4-flash-base", False, "fp8"),  # V4-Flash-Base: float32 scales, copied
    ("tiny-dsv4-flash", True, "fp8"),  # dequantized experts: e8m0 FP8 linears re-encoded in float32, exactly
    ("tiny-k25-dsv4", False, "fp8"),  # Kimi over V4 text: expert_dtype in text_config
    ("tiny-dsv41", False, "fp4"),  # V4.1: 32 x 32 blocks, FP4 experts, Engram rows
    ("tiny-dsv41", True, "fp8"),  # V4.1 with BF16 experts: float32 32 x 32 scales
])
def test_vllm_reads_every_quantized_weight_as_kconvert_does(checkpoint, tmp_path, preset, bf16_experts, experts):
    src = with_bf16_experts(checkpoint(preset), tmp_path / "src") if bf16_experts else checkpoint(preset)
    out = export(src, tmp_path / "fp8")
    config = json.loads((out / "config.json").read_text())
    assert (config.get("text_config") or config)["expert_dtype"] == experts
    as_vllm = vllm_dequantized(out)
    assert any(ROUTED_EXPERT.search(n) for n in as_vllm) and len(as_vllm) > 20
    ck = Checkpoint.open(out)
    assert [n for n, w in as_vllm.items() if not torch.equal(w, ck.read(n, dtype=torch.float32))] == []
    if bf16_experts:  # the source's FP8 linears are copied: their values are the source's, scales re-encoded exactly
        source = Checkpoint.open(src)
        linears = [n for n in as_vllm if not ROUTED_EXPERT.search(n)]
        assert [n for n in linears if not torch.equal(source.read(n, dtype=torch.float32), as_vllm[n])] == []


def test_the_emulation_fails_e8m0_scales_beside_expert_dtype_fp8(checkpoint, tmp_path):
    """The check has teeth: the release's export (e8m0 + FP4 experts) relabelled `expert_dtype: fp8` fails to load as
    vLLM would build it; its FP8 linears' e8m0 scales are read right (a value conversion), and a BF16 source exported
    with e8m0 expert scales beside fp8 (the old export) decodes each routed expert's scale byte as a number."""
    out = export(checkpoint("tiny-dsv4-flash"), tmp_path / "fp8")
    config = json.loads((out / "config.json").read_text())
    config["expert_dtype"] = "fp8"
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="builds an FP8 parameter"):
        vllm_dequantized(out)
    old = export(checkpoint("tiny-dsv4"), tmp_path / "old")
    for f in sorted(old.glob("*.safetensors")):  # float32 scales back to the e8m0 bytes the old export wrote
        tensors = load_file(str(f))
        tensors.update({n: t.to(torch.float8_e8m0fnu) for n, t in tensors.items() if n.endswith(".scale")})
        save_file(tensors, str(f), metadata={"format": "pt"})
    as_vllm, ck = vllm_dequantized(old), Checkpoint.open(old)
    wrong = {n for n, w in as_vllm.items() if not torch.equal(w, ck.read(n, dtype=torch.float32))}
    assert wrong and all(ROUTED_EXPERT.search(n) for n in wrong)
    name = sorted(wrong)[0]
    ratio = (as_vllm[name] / ck.read(name, dtype=torch.float32)).nan_to_num().abs().max()
    assert ratio > 1e4, ratio  # 2^-12 read as 115.0


def test_v41_keeps_expert_dtype_where_its_release_spells_it(checkpoint, tmp_path):
    """V4.1's release carries `expert_dtype` in `quantization_config` (vLLM's V4.1 config falls back to it there): an
    export of a V4.1 that spells it so writes the new value there too, beside the text config's."""
    src = with_bf16_experts(checkpoint("tiny-dsv41"), tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"]["expert_dtype"] = "fp4"
    (src / "config.json").write_text(json.dumps(config))
    out = export(src, tmp_path / "fp8")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["expert_dtype"] == config["text_config"]["expert_dtype"] == "fp8"
    assert config["text_config"]["quantization_config"]["expert_dtype"] == "fp8"
    assert "scale_fmt" not in config["quantization_config"]  # float32 `.scale`: not e8m0 storage
