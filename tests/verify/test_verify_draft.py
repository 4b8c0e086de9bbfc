"""verify checks the draft heads a conversion holds (kconvert/verify/draft.py) on fixtures whose heads are trained
on their own hidden states, so acceptance means something: a clean conversion PASSes with the head's predictions
at the reference's (mean KLD < 1e-5 at --quant none) and its acceptance at the source head's; a head on random
weights or without its shared expert FAILs on acceptance, naming the head, although every token the target
decodes stays right. (One of the 16 routed experts lost moves this tiny head's predictions by a mean KLD of ~2e-5
and its acceptance not at all: at --quant none the prediction check FAILs it; docs/BENCHMARKS.md "Draft heads".)"""

from __future__ import annotations

import json

import pytest

from helpers import cli_here
from kconvert.verify.damage import randomize, zero


@pytest.fixture(scope="module")
def v32(checkpoint, conversion, tmp_path_factory):
    """(source, its reference file, tp 1 and tp 2 --quant none conversions) of tiny-dsv32-trained."""
    from kconvert.verify.prompts import prompts_for
    from kconvert.verify.reference import run_reference

    src = checkpoint("tiny-dsv32-trained")
    ref = tmp_path_factory.mktemp("v32draft") / "ref.safetensors"
    run_reference(str(src), ref, prompts_for(json.loads((src / "config.json").read_text())))
    return src, ref, conversion("tiny-dsv32-trained", tp=1), conversion("tiny-dsv32-trained", tp=2)


def verify(out, ref, src, *extra):
    r = cli_here("verify", out, "--reference", ref, "--against", src, "--json", *extra)
    return r, json.loads(r.stdout)


SHARED_EXPERT = tuple(f"model.layers.3.mlp.shared_experts.{p}_proj.weight" for p in ("gate", "up", "down"))


def test_a_clean_conversion_passes_with_the_source_heads_acceptance(v32):
    """tp 2, --quant none: the head predicts as the source's does and is accepted as often (a draft limit given on
    the command line is the one applied)."""
    src, ref, _, tp2 = v32
    r, rep = verify(tp2, ref, src, "--threshold", "draft.mean_kld=2e-6")
    assert r.returncode == 0, rep["failures"]
    d = rep["draft"]
    head = d["heads"][0]
    assert d["verdict"] == "PASS" and head["head"] == "model.layers.3" and "no reference" in d["reference"]
    assert d["limits"]["mean_kld"] == 2e-6 and d["limits"]["acceptance_drop"] == 0.03
    assert head["mean_kld"] < 2e-6 and head["same_top1_pct"] > 99.9
    assert head["acceptance"] > 0.5 and abs(head["acceptance"] - head["reference_acceptance"]) <= 0.03
    assert head["tokens_per_step"] > 1.4 and head["drafts"] > 100


@pytest.mark.parametrize("damage,what", [
    (lambda out: randomize(out, "model.layers.3.shared_head.head.weight"), "its head on random weights"),
    (lambda out: zero(out, *SHARED_EXPERT), "its shared expert lost (vLLM #43459)"),
], ids=["head-random", "shared-expert-zero"])
def test_a_damaged_head_fails_on_acceptance_naming_it(v32, copy_checkpoint, damage, what):
    """The target is untouched, so its logits PASS; the head's drafts are accepted far less than the source head's."""
    src, ref, tp1, _ = v32
    out = copy_checkpoint(tp1)
    damage(out)
    r, rep = verify(out, ref, src, "--threshold", "draft.new_tokens=16")  # ~55 drafts: the drop is ~80 points
    assert r.returncode == 1, what
    assert rep["faithfulness"]["verdict"] == "PASS" and rep["cost"]["verdict"] == "PASS"
    fails = rep["draft"]["failures"]
    assert any("draft head model.layers.3: acceptance" in f for f in fails), fails
    head = rep["draft"]["heads"][0]
    assert head["acceptance"] < head["reference_acceptance"] - 0.3, head
    assert "draft head model.layers.3" in r.stderr.splitlines()[-1]  # the one line names the head


def test_draft_limits_by_scheme_and_overrides(tmp_path):
    """Each scheme's acceptance budget from manifests/verify_thresholds.toml, `draft.KEY` overrides winning, and none
    of them leaking into the cost budget; an unknown draft key is a usage error."""
    from kconvert.verify.thresholds import draft_limits, limits_for, thresholds

    t = thresholds()["draft"]
    assert draft_limits("none")["acceptance_drop"] == t["acceptance_drop"]["none"]
    assert draft_limits("int4")["acceptance_drop"] == t["acceptance_drop"].get("int4", t["acceptance_drop"]["default"])
    over = {"draft.acceptance_drop": 0.5, "draft.new_tokens": 8, "mean_kld": 0.1}
    assert draft_limits("fp8", over) == {"new_tokens": 8, "mean_kld": t["mean_kld"], "acceptance_drop": 0.5,
                                         "mean_kld_quantized": t["mean_kld_quantized"]}
    _, budget = limits_for("fp8", over)
    assert budget["mean_kld"] == 0.1 and not any(k.startswith("draft") for k in budget)
    r = cli_here("verify", tmp_path, "--threshold", "draft.bogus=1")
    assert r.returncode == 2 and "draft.acceptance_drop" in r.stderr
