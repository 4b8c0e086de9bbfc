"""`kconvert verify` end to end on the trained tiny-k3: clean conversions are faithful to their
fake-quantized reference and within their scheme's budget; damaged ones (consistent checksums, wrong
numbers) FAIL as "the conversion is wrong" and --per-layer names the damaged layer and tensor; a
budget that is too tight FAILs as "too lossy"; a flipped byte is an integrity failure before any
model runs."""

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
def src(checkpoint):
    return checkpoint("tiny-k3-trained")


@pytest.fixture(scope="module")
def ref(src, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "ref.safetensors"
    run_cli("reference", src, "--out", out, "--hidden-states", check=True)
    return out


@pytest.fixture(scope="module")
def fp8_tp2(src, tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8") / "tp2"
    run_cli("shard", src, out, "--tp", 2, "--quant", "fp8", check=True)
    return out


@pytest.fixture(scope="module")
def fp8_faithful(src, fp8_tp2, tmp_path_factory):
    """The faithfulness reference of fp8_tp2; damage keeps kconvert.json's plan, so it serves the damaged copies."""
    out = tmp_path_factory.mktemp("fq") / "fq.safetensors"
    run_cli("reference", src, "--out", out, "--like", fp8_tp2, "--hidden-states", check=True)
    return out


def verify(out, ref, *extra):
    r = run_cli("verify", out, "--reference", ref, "--json", *extra)
    return r, (json.loads(r.stdout) if r.stdout.strip().startswith("{") else None)


@pytest.mark.parametrize("quant", ["none", "int8", "int4"])
def test_clean_conversions_are_faithful(src, ref, tmp_path, quant):
    out = tmp_path / quant
    run_cli("shard", src, out, "--tp", 2, "--quant", quant, check=True)
    r, rep = verify(out, ref)
    assert r.returncode == 0 and rep["verdict"] == "PASS", r.stdout + r.stderr
    faith, cost = rep["faithfulness"], rep["cost"]
    assert faith["verdict"] == "PASS" and faith["overall"]["mean_kld"] < 1e-5, faith["overall"]
    assert set(cost["by_kind"]) == {"short", "long", "chat", "image"}
    if quant == "none":
        assert "copied" in faith["reference"] and cost["overall"]["same_top1_pct"] == 100.0
    else:  # the cost is real and far above the faithfulness figure
        assert cost["overall"]["mean_kld"] > 100 * faith["overall"]["mean_kld"]


def test_fp8_per_layer_reports_both_curves(fp8_tp2, ref, fp8_faithful):
    r, rep = verify(fp8_tp2, ref, "--per-layer", "--faithful-reference", fp8_faithful)
    assert r.returncode == 0 and rep["verdict"] == "PASS", r.stdout + r.stderr
    assert rep["fault_at"] is None and rep["first_fault_layer"] is None and rep["attribution"] is None
    faith, cost = rep["faithfulness"]["per_layer"], rep["cost"]["per_layer"]
    assert len(faith) == len(cost) == 4 and cost[0]["rel_error"] < 1e-5  # embeddings are bf16 copies
    assert max(c["rel_error"] for c in faith) < 1e-4 < cost[-1]["rel_error"]
    assert rep["largest_error_step_layer"] in (0, 1, 2)
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


def _assert_wrong(r, rep, layer: int):
    assert r.returncode == 1 and rep["verdict"] == "FAIL", r.stdout + r.stderr
    assert rep["faithfulness"]["verdict"] == "FAIL"
    assert any(f.startswith("the conversion is wrong") for f in rep["failures"]), rep["failures"]
    assert rep["first_fault_layer"] == layer and rep["fault_at"] == f"layer {layer}"


def test_perturbed_expert_fails_and_is_located(fp8_tp2, ref, fp8_faithful, tmp_path):
    out = _copy(fp8_tp2, tmp_path)
    name = f"{P}2.mlp.experts.0.up_proj.weight"  # an expert the held-out prompts route to (layer 2 uses few)

    def perturb(t):  # the expert's output grows 30x: a corrupted expert, not quantization noise
        t[name + "_scale_inv"] = t[name + "_scale_inv"] * 30

    _rewrite(out, "rank-000/layer-0002.safetensors", perturb)
    assert run_cli("verify-files", out).returncode == 0  # checksums are consistent: only numbers catch it
    r, rep = verify(out, ref, "--per-layer", "--faithful-reference", fp8_faithful)
    _assert_wrong(r, rep, 2)
    assert rep["attribution"][1]["tensor"] == name, rep["attribution"][:4]


def test_wrong_scales_in_one_layer_fail_and_are_located(fp8_tp2, ref, fp8_faithful, tmp_path):
    out = _copy(fp8_tp2, tmp_path)
    name = f"{P}1.self_attn.o_proj.weight"

    def scale_up(t):
        t[name + "_scale_inv"] = t[name + "_scale_inv"] * 8

    for rank in (0, 1):
        _rewrite(out, f"rank-00{rank}/layer-0001.safetensors", scale_up)
    r, rep = verify(out, ref, "--per-layer", "--faithful-reference", fp8_faithful)
    _assert_wrong(r, rep, 1)
    assert rep["attribution"][1]["tensor"] == name and rep["attribution"][1]["share"] > 0.5


def test_one_row_with_its_sign_flipped_fails(fp8_tp2, ref, fp8_faithful, tmp_path):
    """A fault far smaller than the fp8 noise around it: one output row of one projection negated."""
    out = _copy(fp8_tp2, tmp_path)
    name = f"{P}1.self_attn.q_b_proj.weight"

    def flip(t):
        w = t[name].float()
        w[5] = -w[5]
        t[name] = w.to(torch.float8_e4m3fn)

    _rewrite(out, "rank-001/layer-0001.safetensors", flip)
    r, rep = verify(out, ref, "--per-layer", "--faithful-reference", fp8_faithful)
    _assert_wrong(r, rep, 1)
    assert rep["cost"]["verdict"] == "PASS"  # within the fp8 budget: only the faithfulness check sees it
    assert rep["attribution"][1]["tensor"] == name


def test_scheme_over_budget_is_reported_as_too_lossy(fp8_tp2, ref, fp8_faithful):
    r, rep = verify(fp8_tp2, ref, "--faithful-reference", fp8_faithful, "--threshold", "mean_kld=1e-6")
    assert r.returncode == 1 and rep["faithfulness"]["verdict"] == "PASS" and rep["cost"]["verdict"] == "FAIL"
    assert rep["failures"] and all(f.startswith("the scheme is too lossy for this model") for f in rep["failures"])
    assert "too lossy" in r.stderr


def test_experts_swapped_between_ranks_fail(fp8_tp2, ref, fp8_faithful, tmp_path):
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
    r, rep = verify(out, ref, "--per-layer", "--faithful-reference", fp8_faithful)
    _assert_wrong(r, rep, 1)


def test_flipped_byte_is_an_integrity_failure_before_any_model_run(fp8_tp2, ref, tmp_path):
    out = _copy(fp8_tp2, tmp_path)
    f = out / "rank-001" / "layer-0002.safetensors"
    data = bytearray(f.read_bytes())
    data[len(data) - 100] ^= 0x40
    f.write_bytes(bytes(data))
    r = run_cli("verify", out, "--reference", ref)
    assert r.returncode == 1 and "integrity" in r.stderr and "rank-001/layer-0002.safetensors" in r.stderr
    assert "Traceback" not in r.stderr and "engine" not in r.stdout.lower()


def test_bad_inputs(fp8_tp2, ref, fp8_faithful, checkpoint, tmp_path):
    assert_one_line_error(run_cli("verify", fp8_tp2), "--reference")
    other = tmp_path / "other.safetensors"
    run_cli("reference", checkpoint("tiny-dsv32"), "--out", other, "--prompts", "stdlib-heldout", check=True)
    assert_one_line_error(run_cli("verify", fp8_tp2, "--reference", other), "another source")
    assert_one_line_error(run_cli("verify", fp8_tp2, "--reference", ref, "--threshold", "foo=1"), "foo")
    assert_one_line_error(run_cli("verify", fp8_tp2, "--reference", fp8_faithful), "fake-quantized")
    assert_one_line_error(run_cli("verify", fp8_tp2, "--reference", ref, "--faithful-reference", ref),
                          "another conversion")
