"""`kconvert export --format bf16`: the release's layout and names with every quantized tensor dequantized (FP4, FP8,
INT4, V4.1's FP8 rows -> BF16; what fine-tuners ask for), every other tensor as stored, no quantization_config. Exact
where BF16 holds the values (FP4 and FP8 with power-of-two scales: V4's storage); an INT4 group's q x bf16 scale
generally needs more bits than BF16 has, so those tensors are rounded to nearest and counted."""

from __future__ import annotations

import json

import torch
from safetensors import safe_open

from helpers import cli_here
from kconvert.io.dtypes import DTYPES
from kconvert.source.checkpoint import Checkpoint


def export_bf16(src, out) -> dict:
    r = cli_here("export", src, out, "--format", "bf16", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def stored(out) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            tensors.update({k: h.get_tensor(k) for k in h.keys()})
    return tensors


def test_v4_release_storage_dequantizes_exactly(checkpoint, tmp_path):
    src = checkpoint("tiny-dsv4-flash")  # FP8 + e8m0 `.scale`, FP4 experts
    summary = export_bf16(src, tmp_path / "bf16")
    source, out = Checkpoint.open(src), stored(tmp_path / "bf16")
    assert sorted(out) == sorted(source.logical)  # the release's names, every `.scale` folded away
    dequantized = [n for n, t in source.logical.items() if t.format != "plain"]
    assert dequantized and summary["dequantized"] == len(dequantized)
    assert summary["rounded"] == 0 and summary["quantized"] == 0
    for name, t in source.logical.items():
        want = source.read(name, dtype=torch.float32)
        assert out[name].dtype == (torch.bfloat16 if t.format != "plain" else DTYPES[t.stored_dtype]), name
        assert torch.equal(out[name].to(torch.float32), want), name
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert "quantization_config" not in config and "expert_dtype" not in config


def test_int4_experts_are_rounded_to_bf16_and_counted(checkpoint, tmp_path):
    src = checkpoint("tiny-k25-dsv32-int4")
    summary = export_bf16(src, tmp_path / "bf16")
    source, out = Checkpoint.open(src), stored(tmp_path / "bf16")
    packed = [n for n, t in source.logical.items() if t.format == "int4_packed"]
    assert packed and summary["dequantized"] == len(packed)
    assert 0 < summary["rounded"] <= len(packed)
    for name in packed:
        assert torch.equal(out[name], source.read(name, dtype=torch.float32).to(torch.bfloat16)), name
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert "quantization_config" not in config and "quantization_config" not in config["text_config"]
