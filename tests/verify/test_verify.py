"""`kconvert verify` end to end on the trained tiny-k25-dsv32: clean conversions are faithful to their
fake-quantized reference and within their scheme's budget; damaged ones (consistent checksums, wrong
numbers) FAIL as "the conversion is wrong" and --per-layer names the damaged layer and tensor; a
budget that is too tight FAILs as "too lossy"; a flipped byte is an integrity failure before any
model runs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers import assert_one_line_error, cli_here, one_thread, run_cli
from kconvert.verify import damage


@pytest.fixture(scope="module")
def src(checkpoint):
    return checkpoint("tiny-k25-dsv32-trained")


def kconvert(*args) -> None:
    """A command that makes a test's inputs, run in this process (the CLI's own entry point)."""
    r = cli_here(*args)
    assert r.returncode == 0, r.stderr


@pytest.fixture(scope="module")
def ref(src, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "ref.safetensors"
    kconvert("reference", src, "--out", out, "--hidden-states")
    return out


@pytest.fixture(scope="module")
def fp8_tp2(src, tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8") / "tp2"
    kconvert("shard", src, out, "--tp", 2, "--quant", "fp8")
    return out


@pytest.fixture(scope="module")
def fp8_faithful(src, fp8_tp2, tmp_path_factory):
    """The faithfulness reference of fp8_tp2."""
    out = tmp_path_factory.mktemp("fq") / "fq.safetensors"
    kconvert("reference", src, "--out", out, "--like", fp8_tp2, "--hidden-states")
    return out


def verify(out, ref, *extra):
    """`kconvert verify OUT --json`: a tp 2 conversion in a separate process that starts its two ranks; a tp 1
    one in this process (its engine runs in the verify process either way: nothing to start)."""
    args = ("verify", out, "--reference", ref, "--json", *extra)
    if json.loads((Path(out) / "kconvert.json").read_text())["layout"]["tp"] == 1:
        with one_thread():
            r = cli_here(*args)
    else:
        r = run_cli(*args)
    return r, (json.loads(r.stdout) if r.stdout.strip().startswith("{") else None)


@pytest.mark.parametrize("quant,tp", [("none", 1), ("int8", 2), ("int4", 2), ("fp4", 1)])
def test_clean_conversions_are_faithful(src, ref, tmp_path, quant, tp):
    """int8 and int4 at tp 2 (their scales are sliced with the weights; fp8 tp 2 is below); tp 2 of an
    unquantized conversion is the engine's tp 2 = tp 1 (tests/engine/test_engine_tp.py); fp4 (e8m0 scales per
    32 inputs of whole experts) in this process."""
    out = tmp_path / quant
    kconvert("shard", src, out, "--tp", tp, "--quant", quant)
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


# The damage cases (kconvert/verify/damage.py: tensors changed, checksums re-recorded) run on three of the
# nine held-out prompts: the attribution of a faulty layer runs that layer once per tensor (61) over every
# prompt, so its time follows the token count (350 of 2611 here). Each case FAILs and is located on the
# three as on all nine, where bench/verify_damage.py runs them (the damage table in docs/BENCHMARKS.md).
FEW = ("short-1", "chat-1", "image-1")  # every one past 3 x index_topk tokens: sparse attention selects


@pytest.fixture(scope="module")
def few(src, fp8_tp2, tmp_path_factory):
    """{"ref": the unquantized reference, tp: (clean fp8 conversion, its faithfulness reference)} on the FEW
    prompts, for tp 1 (verified in this process: no ranks to start) and tp 2 (the module's fp8_tp2)."""
    from kconvert.verify.prompts import prompts_for

    d = tmp_path_factory.mktemp("few")
    prompts = [p for p in prompts_for(json.loads((src / "config.json").read_text())) if p["id"] in FEW]
    assert len(prompts) == len(FEW)
    (d / "prompts.json").write_text(json.dumps(prompts))
    kconvert("shard", src, d / "fp8-tp1", "--tp", 1, "--quant", "fp8")
    kit = {"ref": d / "ref.safetensors"}
    few_refs = ("--hidden-states", "--prompts", d / "prompts.json")
    kconvert("reference", src, "--out", kit["ref"], *few_refs)
    for tp, conv in ((1, d / "fp8-tp1"), (2, fp8_tp2)):
        kit[tp] = conv, d / f"fq-tp{tp}.safetensors"
        kconvert("reference", src, "--out", kit[tp][1], "--like", conv, *few_refs)
    return kit


def _damaged(few, tp: int, case: str, tmp_path: Path) -> tuple[Path, Path]:
    """(a damaged copy of the clean tp conversion, its faithfulness reference)."""
    clean, fq = few[tp]
    out = tmp_path / "damaged"
    shutil.copytree(clean, out)
    damage.CASES[case].apply(out)
    assert cli_here("verify-files", out).returncode == 0  # checksums are consistent: only numbers catch it
    return out, fq


def _assert_wrong(r, rep: dict, layer: int):
    assert r.returncode == 1 and rep["verdict"] == "FAIL", r.stdout + r.stderr
    assert rep["faithfulness"]["verdict"] == "FAIL" and "the conversion is wrong" in r.stderr
    assert any(f.startswith("the conversion is wrong") for f in rep["failures"]), rep["failures"]
    assert rep["first_fault_layer"] == layer and rep["fault_at"] == f"layer {layer}"


@pytest.mark.parametrize("case", [c for c, d in damage.CASES.items() if d.min_tp == 1])
def test_damage_fails_and_is_located(few, tmp_path, case):
    """One expert's scales x30, one layer's o_proj scales x8, one q_b_proj row negated (a fault far below
    fp8's noise): FAIL as "the conversion is wrong", first fault in the damaged layer, damaged tensor blamed."""
    out, fq = _damaged(few, 1, case, tmp_path)
    r, rep = verify(out, few["ref"], "--per-layer", "--faithful-reference", fq)
    want = damage.CASES[case]
    _assert_wrong(r, rep, want.layer)
    top = rep["attribution"][1]
    assert top["tensor"] == want.tensor and top["share"] > 0.5, rep["attribution"][:4]
    if case == "one row sign-flipped":  # within the fp8 budget: only the faithfulness check sees it
        assert rep["cost"]["verdict"] == "PASS", rep["cost"]["failures"]


def test_experts_swapped_between_ranks_fail(few, tmp_path):
    """Rank 0's experts (0-7) and rank 1's (8-15) of layer 1 exchanged: what a wrong rank order does. Through
    the CLI, with the tp 2 ranks it starts. No single tensor explains it (one expert made faithful is still a
    mix), but the attribution gathered on rank 0 moves with the experts each rank made faithful, and only them."""
    out, fq = _damaged(few, 2, "experts swapped between ranks", tmp_path)
    r, rep = verify(out, few["ref"], "--per-layer", "--faithful-reference", fq)
    _assert_wrong(r, rep, 1)
    moved = [a["tensor"] for a in rep["attribution"][1:] if abs(a["share"]) > 1e-4]
    assert moved and all(".mlp.experts." in t for t in moved), rep["attribution"][:6]
    experts = {int(t.split(".mlp.experts.")[1].split(".")[0]) for t in moved}
    assert min(experts) < 8 <= max(experts), experts  # experts held by rank 0 and by rank 1


def test_scheme_over_budget_is_reported_as_too_lossy(few):
    clean, fq = few[1]
    r, rep = verify(clean, few["ref"], "--faithful-reference", fq, "--threshold", "mean_kld=1e-6")
    assert r.returncode == 1 and rep["faithfulness"]["verdict"] == "PASS" and rep["cost"]["verdict"] == "FAIL"
    assert rep["failures"] and all(f.startswith("the scheme is too lossy for this model") for f in rep["failures"])
    assert "too lossy" in r.stderr


def test_flipped_byte_is_an_integrity_failure_before_any_model_run(fp8_tp2, ref, tmp_path):
    out = tmp_path / "flipped"
    shutil.copytree(fp8_tp2, out)
    f = out / "rank-001" / "layer-0002.safetensors"
    data = bytearray(f.read_bytes())
    data[len(data) - 100] ^= 0x40
    f.write_bytes(bytes(data))
    r = cli_here("verify", out, "--reference", ref)
    assert r.returncode == 1 and "integrity" in r.stderr and "rank-001/layer-0002.safetensors" in r.stderr
    assert "Traceback" not in r.stderr and "engine" not in r.stdout.lower()


def test_bad_inputs(fp8_tp2, ref, fp8_faithful, checkpoint, tmp_path):
    """Each is refused before any model runs: in this process (cli_here), through the CLI's error handling."""
    assert_one_line_error(cli_here("verify", fp8_tp2), "--reference")
    other, one = tmp_path / "other.safetensors", tmp_path / "one.json"
    one.write_text(json.dumps([{"id": "s", "kind": "short", "text": "def f(x):\n    return x"}]))
    assert cli_here("reference", checkpoint("tiny-dsv32"), "--out", other, "--prompts", one).returncode == 0
    assert_one_line_error(cli_here("verify", fp8_tp2, "--reference", other), "another source")
    assert_one_line_error(cli_here("verify", fp8_tp2, "--reference", ref, "--threshold", "foo=1"), "foo")
    assert_one_line_error(cli_here("verify", fp8_tp2, "--reference", fp8_faithful), "fake-quantized")
    assert_one_line_error(cli_here("verify", fp8_tp2, "--reference", ref, "--faithful-reference", ref),
                          "another conversion")
