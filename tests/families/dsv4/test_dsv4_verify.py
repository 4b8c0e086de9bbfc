"""`kconvert verify` on DeepSeek-V4: the release's FP8 + FP4 storage converted with its FP4 experts kept (or
re-encoded as FP8) is faithful (the reference runs on kconvert's exact dequantization of the release, which transformers cannot run
on CPU) and cheap; a damaged conversion FAILs with the damaged layer and tensor named through the mHC streams."""

from __future__ import annotations

import json
import shutil

import pytest

from helpers import cli_here, one_thread
from kconvert.verify import damage


@pytest.fixture(scope="module")
def flash(checkpoint, tmp_path_factory):
    d = tmp_path_factory.mktemp("dsv4verify")
    src = checkpoint("tiny-dsv4-flash")
    for args in (("shard", src, d / "fp4", "--tp", 1, "--quant", "fp4"),
                 ("shard", src, d / "fp8", "--tp", 1, "--quant", "fp8"),
                 ("reference", src, "--out", d / "ref.safetensors", "--hidden-states")):
        r = cli_here(*args)
        assert r.returncode == 0, r.stderr
    return d


def verify(out, ref):
    with one_thread():
        r = cli_here("verify", out, "--reference", ref, "--per-layer", "--json")
    return r, json.loads(r.stdout)


def test_fp4_kept_conversion_is_faithful(flash):
    r, rep = verify(flash / "fp4", flash / "ref.safetensors")
    assert r.returncode == 0 and rep["verdict"] == "PASS", r.stderr
    assert rep["faithfulness"]["overall"]["mean_kld"] < 1e-6 and rep["fault_at"] is None
    assert max(c["rel_error"] for c in rep["faithfulness"]["per_layer"]) < 1e-4


def test_fp4_experts_transcoded_to_fp8_are_lossless(flash):
    """GPUs without FP4: --quant fp8 re-encodes the FP4 experts exactly, so the conversion costs nothing
    against the dequantized release (the reference here), not just against its own fake-quantized twin."""
    r, rep = verify(flash / "fp8", flash / "ref.safetensors")
    assert r.returncode == 0 and rep["verdict"] == "PASS", r.stderr
    assert rep["cost"]["overall"]["mean_kld"] < 1e-5 and rep["cost"]["overall"]["same_top1_pct"] == 100.0


def test_damaged_v4_conversion_fails_with_layer_and_tensor(flash, tmp_path):
    out = tmp_path / "damaged"
    shutil.copytree(flash / "fp4", out)
    name = "layers.1.attn.wq_b.weight"

    def flip(t):  # one output row negated: only the numbers can tell
        t[name][5] = -t[name][5]

    damage.rewrite(out, damage.files_holding(out, name)[0], flip)
    r, rep = verify(out, flash / "ref.safetensors")
    assert r.returncode == 1 and rep["faithfulness"]["verdict"] == "FAIL" and "the conversion is wrong" in r.stderr
    assert rep["fault_at"] == "layer 1" and rep["attribution"][1]["tensor"] == name, rep["attribution"][:3]
