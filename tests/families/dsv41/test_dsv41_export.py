"""`kconvert export --format fp8-block` of DeepSeek-V4.1 (and DeepSeek-V4) is the release's own layout: the 32 x 32
FP8 blocks, the FP4 experts and the Engram tables' FP8 rows copied byte for byte, `weight_block_size` [32, 32]; and
`kconvert verify` checks such an export against the source (the copies hold the source's values): it PASSes, and a
damaged FP4 expert or Engram row FAILs it."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import cli_here, verify_json


def _tensors(folder) -> dict:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.fixture(scope="module")
def v41(tmp_path_factory):
    d = tmp_path_factory.mktemp("v41-export")
    for args in (("fixture", "tiny-dsv41", d / "src"), ("export", d / "src", d / "fp8", "--format", "fp8-block"),
                 ("reference", d / "src", "--out", d / "ref.safetensors")):
        r = cli_here(*args)
        assert r.returncode == 0, r.stderr
    return d


verify = verify_json


def test_the_fp8_block_export_of_v41_is_the_release(v41):
    src, exp = _tensors(v41 / "src"), _tensors(v41 / "fp8")
    assert set(src) == set(exp)
    for name, t in src.items():
        assert exp[name].dtype == t.dtype and torch.equal(exp[name].view(torch.uint8), t.view(torch.uint8)), name
    cfg = json.loads((v41 / "fp8" / "config.json").read_text())
    assert cfg["quantization_config"]["weight_block_size"] == [32, 32] and cfg["text_config"]["expert_dtype"] == "fp4"


@pytest.mark.parametrize("what,name,flip", [
    (None, None, 0),
    ("an FP4 expert", "layers.2.ffn.experts.3.w1.weight", 0x88),  # both codes of a byte change sign
    ("an Engram row", "layers.1.engram.embed.weight", 0x80),  # e4m3 sign bit
])
def test_verify_checks_the_export_and_fails_a_damaged_copy(v41, tmp_path, what, name, flip):
    import shutil

    out = tmp_path / "exp"
    shutil.copytree(v41 / "fp8", out)
    if name:
        f = next(p for p in sorted(out.glob("*.safetensors")) if name in load_file(str(p)))
        tensors = load_file(str(f))
        raw = tensors[name].view(torch.uint8).clone()
        raw[:3] ^= flip
        tensors[name] = raw.view(tensors[name].dtype)
        save_file(tensors, str(f), metadata={"format": "pt"})
    r, rep = verify(out, v41 / "ref.safetensors")
    if what is None:
        assert r.returncode == 0 and rep["faithfulness"]["overall"]["mean_kld"] < 1e-5, r.stderr
    else:
        assert r.returncode == 1 and rep["faithfulness"]["verdict"] == "FAIL", (what, r.stderr)


def test_a_deepseek_v4_release_export_verifies(checkpoint, tmp_path):
    """DeepSeek-V4-Flash's storage (FP8 128 x 128 + FP4 experts) exported as fp8-block keeps its FP4 experts: verify
    reads them as the source's own values (it used to apply the FP8 block rule to them and stop)."""
    src = checkpoint("tiny-dsv4-flash")
    out, ref = tmp_path / "fp8", tmp_path / "ref.safetensors"
    for args in (("export", src, out, "--format", "fp8-block"), ("reference", src, "--out", ref)):
        r = cli_here(*args)
        assert r.returncode == 0, r.stderr
    r, rep = verify(out, ref)
    assert rep is not None and rep["faithfulness"]["verdict"] == "PASS", r.stderr
