"""`kconvert verify` end to end: clean conversions PASS within their scheme's bounds, damaged ones
(consistent checksums, wrong numbers) FAIL and --per-layer points at the damaged layer and tensor,
and a flipped byte is an integrity failure before any model runs."""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import assert_one_line_error, run_cli, rewrite_catalog


@pytest.fixture(scope="module")
def ref(checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "ref.safetensors"
    run_cli("reference", checkpoint("tiny-k3"), "--out", out, "--hidden-states", check=True)
    return out


@pytest.fixture(scope="module")
def fp8_tp2(checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8") / "tp2"
    run_cli("shard", checkpoint("tiny-k3"), out, "--tp", 2, "--quant", "fp8", check=True)
    return out


def verify(out, ref, *extra):
    r = run_cli("verify", out, "--reference", ref, "--json", *extra)
    return r, (json.loads(r.stdout) if r.stdout.strip().startswith("{") else None)


@pytest.mark.parametrize("quant", ["none", "int8"])
def test_clean_conversions_pass(checkpoint, ref, tmp_path, quant):
    out = tmp_path / quant
    run_cli("shard", checkpoint("tiny-k3"), out, "--tp", 2, "--quant", quant, check=True)
    r, rep = verify(out, ref)
    assert r.returncode == 0 and rep["verdict"] == "PASS", r.stdout + r.stderr
    assert set(rep["by_kind"]) == {"short", "long", "chat", "image"}
    if quant == "none":
        assert rep["overall"]["mean_kld"] < 1e-6 and rep["overall"]["same_top1_pct"] == 100.0


def test_fp8_passes_and_per_layer_reports(fp8_tp2, ref, tmp_path):
    r, rep = verify(fp8_tp2, ref, "--per-layer")
    assert r.returncode == 0 and rep["verdict"] == "PASS", r.stdout + r.stderr
    assert 0 < rep["overall"]["mean_kld"] < rep["thresholds"]["mean_kld"]
    assert len(rep["per_layer"]) == 4 and rep["per_layer"][0]["rel_error"] < 1e-5  # embeddings are bf16 copies
    assert rep["vision_error"] < 1e-4  # the vision tower is kept in bf16


def _rewrite(out: Path, rel: str, mutate) -> None:
    """Change tensors of one converted file and re-record its checksums: damage verify-files cannot see."""
    tensors = load_file(out / rel)
    mutate(tensors)
    save_file(tensors, out / rel, metadata={"format": "pt"})
    meta = json.loads((out / "kconvert.json").read_text())
    data = (out / rel).read_bytes()
    meta["files"][rel].update(bytes=len(data), crc32=f"{zlib.crc32(data):08x}")
    (n,) = [int.from_bytes(data[:8], "little")]
    header = json.loads(data[8:8 + n])
    for t in meta["tensors"]:
        if t["file"] == rel:
            lo, hi = header[t["name"]]["data_offsets"]
            t["crc32"] = f"{zlib.crc32(data[8 + n + lo:8 + n + hi]):08x}"
    rewrite_catalog(out, meta)


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "damaged"
    shutil.copytree(src, dst)
    return dst


P = "language_model.model.layers."


def test_perturbed_expert_fails_and_is_located(fp8_tp2, ref, tmp_path):
    out = _copy(fp8_tp2, tmp_path)
    name = f"{P}2.mlp.experts.3.up_proj.weight"

    def perturb(t):  # the expert's output grows 30x: a corrupted expert, not quantization noise
        t[name + "_scale_inv"] = t[name + "_scale_inv"] * 30

    _rewrite(out, "rank-000/layer-0002.safetensors", perturb)
    assert run_cli("verify-files", out).returncode == 0  # checksums are consistent: only numbers catch it
    r, rep = verify(out, ref, "--per-layer")
    assert r.returncode == 1 and rep["verdict"] == "FAIL"
    assert rep["first_bad_layer"] == 2
    assert rep["attribution"][1]["tensor"] == name, rep["attribution"][:4]


def test_wrong_scales_in_one_layer_fail_and_are_located(fp8_tp2, ref, tmp_path):
    out = _copy(fp8_tp2, tmp_path)
    name = f"{P}1.self_attn.o_proj.weight"

    def scale_up(t):
        t[name + "_scale_inv"] = t[name + "_scale_inv"] * 8

    for rank in (0, 1):
        _rewrite(out, f"rank-00{rank}/layer-0001.safetensors", scale_up)
    r, rep = verify(out, ref, "--per-layer")
    assert r.returncode == 1 and rep["first_bad_layer"] == 1
    assert rep["attribution"][1]["tensor"] == name and rep["attribution"][1]["share"] > 0.5


def test_experts_swapped_between_ranks_fail(fp8_tp2, ref, tmp_path):
    """Rank 0's experts (0-7) and rank 1's (8-15) of layer 1 exchanged: what a wrong rank order does."""
    out = _copy(fp8_tp2, tmp_path)
    files = [out / f"rank-00{r}/layer-0001.safetensors" for r in (0, 1)]
    r0, r1 = load_file(files[0]), load_file(files[1])

    def renumber(src: dict, shift: int) -> dict:
        moved = {}
        for k, v in src.items():
            if ".mlp.experts." in k:
                head, rest = k.split(".mlp.experts.")
                e, tail = rest.split(".", 1)
                moved[f"{head}.mlp.experts.{int(e) + shift}.{tail}"] = v
        return moved

    into0, into1 = renumber(r1, -8), renumber(r0, 8)
    _rewrite(out, "rank-000/layer-0001.safetensors", lambda t: t.update(into0))
    _rewrite(out, "rank-001/layer-0001.safetensors", lambda t: t.update(into1))
    r, rep = verify(out, ref, "--per-layer")
    assert r.returncode == 1 and rep["verdict"] == "FAIL"
    assert rep["first_bad_layer"] == 1


def test_flipped_byte_is_an_integrity_failure_before_any_model_run(fp8_tp2, ref, tmp_path):
    out = _copy(fp8_tp2, tmp_path)
    f = out / "rank-001" / "layer-0002.safetensors"
    data = bytearray(f.read_bytes())
    data[len(data) - 100] ^= 0x40
    f.write_bytes(bytes(data))
    r = run_cli("verify", out, "--reference", ref)
    assert r.returncode == 1 and "integrity" in r.stderr and "rank-001/layer-0002.safetensors" in r.stderr
    assert "Traceback" not in r.stderr and "engine" not in r.stdout.lower()


def test_bad_inputs(fp8_tp2, ref, checkpoint, tmp_path):
    assert_one_line_error(run_cli("verify", fp8_tp2), "--reference")
    other = tmp_path / "other.safetensors"
    run_cli("reference", checkpoint("tiny-dsv32"), "--out", other, check=True)
    assert_one_line_error(run_cli("verify", fp8_tp2, "--reference", other), "another source")
    assert_one_line_error(run_cli("verify", fp8_tp2, "--reference", ref, "--threshold", "foo=1"), "foo")
