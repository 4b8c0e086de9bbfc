"""The trained fixtures: they learned something, from a corpus the verify prompts are not drawn from,
reproducibly, and both presets share one trained text model."""

from __future__ import annotations

import json

import torch

from helpers import load_source, run_cli
from kconvert.fixtures import trained
from kconvert.verify.prompts import HELD_OUT_FILES, heldout_prompts, stdlib_text


def test_trained_fixture_learned_and_records_how(checkpoint):
    src = checkpoint("tiny-k3-trained")
    rec = json.loads((src / "kconvert_training.json").read_text())
    assert rec["loss_first"] > 9 and rec["loss_last10_mean"] < rec["loss_first"] - 4, rec
    cfg = json.loads((src / "config.json").read_text())
    assert cfg["kconvert_prompts"] == "stdlib-heldout"
    assert not set(rec["corpus"]) & set(HELD_OUT_FILES)


def test_both_trained_presets_share_the_text_model(checkpoint):
    k3 = load_source(checkpoint("tiny-k3-trained"))
    ds = load_source(checkpoint("tiny-dsv32-trained"))
    plain = load_source(checkpoint("tiny-dsv32"))
    name = "model.layers.1.self_attn.q_b_proj.weight"
    assert torch.equal(k3["language_model." + name], ds[name])
    assert not torch.equal(ds[name], plain[name])  # trained, not the random init


def test_heldout_prompts_come_from_unseen_text():
    corpus = stdlib_text(trained.CORPUS_FILES)
    held = stdlib_text(HELD_OUT_FILES)
    prompts = heldout_prompts(16, vision=True)
    assert {p["kind"] for p in prompts} == {"short", "long", "chat", "image"}
    for p in prompts:
        text = p.get("text") or p["chat"][-1]["content"].split("\n", 1)[1]
        probe = text.strip()[:60]
        assert probe in held and probe not in corpus, probe
    assert all(len(p["text"]) >= 3 * 16 * 4 for p in prompts if p["kind"] == "long")


def test_training_is_reproducible(monkeypatch):
    """Same seed, same weights (a 3-step run: the full run is the session fixture above)."""
    monkeypatch.setattr(trained, "STEPS", 3)
    trained.trained_text_state.cache_clear()
    a, la = trained.trained_text_state(5)
    trained.trained_text_state.cache_clear()
    b, lb = trained.trained_text_state(5)
    trained.trained_text_state.cache_clear()
    assert la == lb and all(torch.equal(a[k], b[k]) for k in a)


def test_fixture_cli_reports_training(checkpoint, tmp_path):
    r = run_cli("fixture", "tiny-k3-trained", tmp_path / "x", "--seed", "-1")
    assert r.returncode == 2 and "seed" in r.stderr
    assert "tiny-k3-trained" in run_cli("fixture", "--help").stdout
