"""Calibrated NVFP4 (`shard --quant nvfp4 --calibrate DATA`): GPTQ codes at the uncalibrated path's scales, layer by
layer through the engine (a better layer output than nearest codes), stored in ModelOpt's NVFP4 layout with a fused
w1 / w3 pair's one weight_scale_2 and read back by verify; an MXFP4 source's experts stay exact casts (nothing to
calibrate); a scheme without a calibrated path or an int4 grid named for nvfp4 is refused in one line.
Tiny: tiny-k25-dsv32 (random weights, BF16 experts) with a few hundred calibration tokens; what the codes cost on
trained weights is bench/verify_bench.py's (nvfp4-gptq rows, docs/BENCHMARKS.md "NVFP4")."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import assert_one_line_error, cli_here, cli_runs, one_thread, shard_job, stored_tensors, verify_json
from kconvert.disk_format.catalog import Catalog
from kconvert.convert.shard.job import shard
from kconvert.source.calibration_data import calibration_windows

TOKENS, SEQ = 256, 64
SHARED = ("*shared_experts*",)  # NVFP4 and calibrated too, and cut by tp 2 (rows and columns): the whole tensor's scale


def _make():
    from cli.calibrate_opts import calibration_factory

    return calibration_factory("stdlib", TOKENS, SEQ, 0, None)  # shard's factory: nvfp4 picks its own grid


@pytest.fixture(scope="module")
def calibrated(checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("calib_nvfp4") / "tp2"
    job = shard_job(checkpoint("tiny-k25-dsv32"), out, tp=2, quant="nvfp4", force=SHARED, workers=1)
    return out, shard(job, calibrate=_make())


def test_gptq_layer_beats_rounding_and_is_what_shard_stores(calibrated, checkpoint, monkeypatch):
    """Layer 1's output is closer to the unquantized layer's with GPTQ codes than with nearest ones (every expert
    given too few tokens) at the same scales; what the tp 2 shard stores, decoded by verify's own NVFP4 decoder and
    its slices put together, is these whole-tensor codes times their scales; kconvert.json records gptq / nvfp4."""
    from engine.calibrate import layerwise as cal
    from kconvert.quant.gptq import NVFP4
    from kconvert.quant.policy import QuantPolicy
    from kconvert.source.checkpoint import Checkpoint
    from kconvert.source.tokenizer import load_kimi_tokenizer
    from kconvert.verify.stored_codes import stored_pieces

    ck = Checkpoint.open(checkpoint("tiny-k25-dsv32"))
    enc = load_kimi_tokenizer(ck.root)
    windows, record = calibration_windows("stdlib", lambda t: enc.encode(t, allowed_special="all"), TOKENS, SEQ, seed=0)
    policy = QuantPolicy("nvfp4", force=SHARED, family=ck.model.family)
    with one_thread():
        gptq = cal.LayerCalibration(ck, windows, policy, NVFP4, record)
        got = gptq.layer(1)
        monkeypatch.setattr(cal, "MIN_EXPERT_TOKENS", 10**9)
        rtn = cal.LayerCalibration(ck, windows, policy, NVFP4, record)
        near = rtn.layer(1)
    assert got.keys() == near.keys() and len(got) == 48 + 3  # 16 experts x gate, up, down; the shared expert
    for n in got:  # static scales: block scales and weight_scale_2 as rounding to nearest has them
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got[n][1:], near[n][1:])), n
    changed = sum(int((got[n][0] != near[n][0]).sum()) for n in got) / sum(got[n][0].numel() for n in got)
    assert 0.02 < changed < 0.6
    a, b = gptq.figures[-1], rtn.figures[-1]
    assert a["experts_rounded_few_tokens"] == 0 and b["experts_rounded_few_tokens"] == 16
    assert a["output_rel_error"] < 0.9 * b["output_rel_error"], (a, b)
    out, result = calibrated
    assert result.details.calibration["layers"][1]["output_rel_error"] == a["output_rel_error"]
    q = Catalog.read(out).doc["quantization"]
    assert q["scheme"] == "nvfp4" and q["calibration"]["method"] == "gptq" and q["calibration"]["grid"] == "nvfp4"
    meta = Catalog.read(out).whole_doc()
    stored = {}
    for name, pieces in stored_pieces(out, meta).items():
        stored[name] = torch.cat([w for _, w in sorted(pieces, key=lambda p: p[0][1])], dim=pieces[0][0][0]) \
            if pieces[0][0] else pieces[0][1]
    for n, parts in got.items():
        assert torch.equal(stored[n], NVFP4.dequantize(parts)), n


def test_stored_in_modelopts_layout_with_one_scale_per_fused_pair_and_verify_reads_it(calibrated, checkpoint,
                                                                                     tmp_path):
    out, _ = calibrated
    t = stored_tensors(out, "language_model.model.layers.1.mlp.")
    experts = sorted({k.split(".experts.")[1].split(".")[0] for k in t if ".experts." in k}, key=int)
    assert len(experts) == 16
    for e in experts:
        p = f"language_model.model.layers.1.mlp.experts.{e}."
        for proj in ("gate_proj", "up_proj", "down_proj"):
            w = p + proj + "."
            assert t[w + "weight"].dtype == torch.uint8 and t[w + "weight_scale"].dtype == torch.float8_e4m3fn
            assert t[w + "weight_scale_2"].dtype == torch.float32 and t[w + "input_scale"].dtype == torch.float32
        assert torch.equal(t[p + "gate_proj.weight_scale_2"], t[p + "up_proj.weight_scale_2"]), e
    ref = tmp_path / "ref.safetensors"
    cli_runs({"ref": ("reference", checkpoint("tiny-k25-dsv32"), "--out", ref)})
    r, rep = verify_json(out, ref)
    assert rep is not None, r.stderr
    assert rep["faithfulness"]["overall"]["mean_kld"] < 1e-5, rep["faithfulness"]  # its own stored codes, loaded back


def test_mxfp4_experts_stay_exact_casts(checkpoint, tmp_path):
    """V4-Flash's MXFP4 experts cast to NVFP4 code for code: --calibrate leaves them so (the bytes of the
    uncalibrated conversion) and says so in its record."""
    src = checkpoint("tiny-dsv4-flash")
    args = ("--tp", 1, "--quant", "nvfp4", "--no-draft-heads")
    runs = cli_runs({"cal": ("shard", src, tmp_path / "cal", *args, "--calibrate", "stdlib", "--calibration-tokens",
                             TOKENS, "--calibration-seq", SEQ, "--json"),
                     "rtn": ("shard", src, tmp_path / "rtn", *args)})
    cal = json.loads(runs["cal"].stdout)["calibration"]
    assert cal["grid"] == "nvfp4" and cal["calibrated"] == 0 and cal["copied_exactly"] == 96
    files = lambda d: {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*.safetensors"))}  # noqa: E731
    assert files(tmp_path / "cal") == files(tmp_path / "rtn")


def test_bad_input_is_one_line(checkpoint, tmp_path):
    src = checkpoint("tiny-k25-dsv32")
    proc = cli_here("shard", src, tmp_path / "o1", "--tp", "1", "--quant", "fp8", "--calibrate", "stdlib")
    assert_one_line_error(proc, "--calibrate", "fp8")
    proc = cli_here("shard", src, tmp_path / "o2", "--tp", "1", "--quant", "nvfp4", "--calibrate", "stdlib",
                    "--calibration-grid", "kimi")
    assert_one_line_error(proc, "--calibration-grid kimi", "nvfp4")
    assert not (tmp_path / "o2" / "kconvert.json").exists()


def test_calibrated_nvfp4_export_keeps_the_scales_and_moves_codes(checkpoint, tmp_path):
    """export --format nvfp4-ct --calibrate: the block and global scales of the uncalibrated export, a share of the
    codes moved, the index's job records the nvfp4 grid."""
    from cli.calibrate_opts import calibration_factory
    from helpers import load_source
    from kconvert.convert.export.job import ExportJob, export

    src = checkpoint("tiny-k25-dsv32")
    export(ExportJob(str(src), str(tmp_path / "gptq"), "nvfp4-ct"),
           calibrate=calibration_factory("stdlib", TOKENS, SEQ, 0, None, ("minmax", "kimi")))
    export(ExportJob(str(src), str(tmp_path / "rtn"), "nvfp4-ct"))
    gptq, rtn = load_source(tmp_path / "gptq"), load_source(tmp_path / "rtn")
    index = json.loads((tmp_path / "gptq" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["kconvert_job"]["calibration"]["grid"] == "nvfp4"
    packed = [n for n in gptq if n.endswith(".weight_packed")]
    assert len(packed) == 96 and gptq.keys() == rtn.keys()
    for n in gptq:
        if not n.endswith("_packed"):
            assert torch.equal(gptq[n].view(torch.uint8), rtn[n].view(torch.uint8)), n
    assert sum(int((gptq[n] != rtn[n]).sum()) for n in packed) > 0
