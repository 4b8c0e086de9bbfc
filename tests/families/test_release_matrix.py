"""The release matrix (kconvert/fixtures/models/releases.py, docs/RELEASES.md): every variant users download today,
as a tiny checkpoint in its exact release storage, inspects as that release (the family manifest's
[[family.variants]]), converts with the scheme that keeps its storage, and verifies against its family's reference
on short text (and image) prompts. Where a release's config disagrees with its tensors, inspect warns by the rule
(kconvert/inspect/disagreements.py) and the rule reads it: V4-Flash-0731's three stages, Kimi K3's ignore list as
shipped, its A_log wider than its heads."""

from __future__ import annotations

import json

import pytest

from helpers import cli_here, verify_json
from kconvert.fixtures.models.releases import BY_PRESET, RELEASES

TEXT = ("The converter streams each layer of the checkpoint, slices it for every rank and writes it with its scales. "
        "def route(tokens, experts): return topk(scores, k). ") * 4
IMAGE = {"id": "image", "kind": "image", "text": "Describe this picture.", "image": {"seed": 1, "width": 84, "height": 56}}
BUILDS = sorted({r.build: r.preset for r in RELEASES}.values())  # a row that repeats another's build: same checkpoint


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    d = tmp_path_factory.mktemp("prompts")
    text = [{"id": "text", "kind": "long", "text": TEXT}]
    (d / "text.json").write_text(json.dumps(text))
    (d / "image.json").write_text(json.dumps(text + [IMAGE]))
    return d


def _inspect(src) -> tuple[dict, str]:
    r = cli_here("inspect", src, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout), r.stderr


@pytest.mark.parametrize("preset", BUILDS)
def test_each_release_inspects_shards_and_verifies(preset, checkpoint, prompts, tmp_path):
    row = BY_PRESET[preset]
    src = checkpoint(preset)
    summary, _ = _inspect(src)
    assert summary["family"] == row.family and summary["variant"]["name"] == row.variant, summary["variant"]
    r = cli_here("shard", src, tmp_path / "tp1", "--tp", 1, "--quant", row.scheme)
    assert r.returncode == 0, r.stderr
    vision = "vision_config" in json.loads((src / "config.json").read_text())
    r = cli_here("reference", src, "--out", tmp_path / "ref.safetensors", "--prompts",
                 prompts / ("image.json" if vision else "text.json"))
    assert r.returncode == 0, r.stderr
    # a row whose conversion rounds its values (row.rounds) is judged as random weights are: the none budget is
    # calibrated on a trained model, and one of random weights moves more for the same rounding
    loose = ("--threshold", "mean_kld=1e-3", "--threshold", "p99_kld=1e-2") if row.rounds else ()
    r, rep = verify_json(tmp_path / "tp1", tmp_path / "ref.safetensors", "--threshold", "draft.new_tokens=4", *loose)
    assert r.returncode == 0 and rep["verdict"] == "PASS", (r.stderr, rep and rep["failures"])
    assert rep["faithfulness"]["overall"]["mean_kld"] < 1e-5, rep["faithfulness"]["overall"]  # the release, read exactly
    if not row.rounds:
        assert rep["cost"]["overall"]["mean_kld"] < 1e-5, rep["cost"]["overall"]
    print(f"\n{preset}: variant {summary['variant']['name']}, --quant {row.scheme}, faithful "
          f"{rep['faithfulness']['overall']['mean_kld']:.2e}, against the reference {rep['cost']['overall']['mean_kld']:.2e}")


@pytest.mark.parametrize("preset", sorted(set(BY_PRESET) - set(BUILDS)))
def test_a_release_nothing_tells_apart_is_its_twin(preset, checkpoint):
    """V4.1-Flash-1017 and Kimi K3.1: nothing known differs, so their rows are their twins' checkpoints."""
    twin = next(r.preset for r in RELEASES if r.build == BY_PRESET[preset].build and r.preset in BUILDS)
    a, b = checkpoint(preset), checkpoint(twin)
    assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
    assert all((a / p.name).read_bytes() == (b / p.name).read_bytes() for p in a.iterdir())


def test_a_checkpoint_of_no_release_names_none(checkpoint):
    summary, _ = _inspect(checkpoint("tiny-dsv4"))  # bf16 V4: no release stores it so
    assert summary["variant"] is None


def test_v4_0731_stages_are_counted_from_their_names(checkpoint):
    summary, stderr = _inspect(checkpoint("release-deepseek-v4-flash-0731"))
    assert summary["model"]["mtp_layers"] == 3
    assert "num_nextn_predict_layers 1, the checkpoint stores 3 draft stages" in stderr
    assert not [w for w in _inspect(checkpoint("release-deepseek-v4-flash"))[0]["warnings"] if "draft stages" in w]


def test_k3_as_shipped_warns_of_its_ignore_list_and_its_a_log(checkpoint, copy_checkpoint):
    src = checkpoint("release-kimi-k3")
    summary, stderr = _inspect(src)
    listed = next(w for w in summary["warnings"] if "ignore does not name" in w)
    for kind in ("mlp_res_proj", "self_attention_res_proj", "output_attn_res_proj", "routed_expert_down_proj",
                 "routed_expert_up_proj"):
        assert kind in listed, listed
    assert "block_sparse_moe.gate" not in listed  # a router is no linear a quantization list targets
    assert "A_log holds 32 values for 4 KDA heads" in stderr
    fixed = copy_checkpoint(src)  # the list as llm-compressor 0.14 patches it: no warning
    config = json.loads((fixed / "config.json").read_text())
    config["text_config"]["quantization_config"]["ignore"] += ["re:.*_res_proj$", "re:.*routed_expert_.*"]
    (fixed / "config.json").write_text(json.dumps(config))
    assert not [w for w in _inspect(fixed)[0]["warnings"] if "ignore does not name" in w]
