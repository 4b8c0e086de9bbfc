"""The trained fixtures: they learned something, from a corpus the verify prompts are not drawn from,
reproducibly, and both presets share one trained text model."""

from __future__ import annotations

import json

import torch

from helpers import cli_here, load_source
from kconvert.fixtures.training import text as trained
from kconvert.verify.prompts import HELD_OUT_FILES, heldout_prompts, stdlib_text


def test_trained_fixture_learned_and_records_how(checkpoint):
    src = checkpoint("tiny-k25-dsv32-trained")
    rec = json.loads((src / "kconvert_training.json").read_text())
    assert rec["loss_first"] > 9 and rec["loss_last10_mean"] < rec["loss_first"] - 4, rec
    cfg = json.loads((src / "config.json").read_text())
    assert cfg["kconvert_prompts"] == "stdlib-heldout"
    assert not set(rec["corpus"]) & set(HELD_OUT_FILES)


def test_both_trained_presets_share_the_text_model(checkpoint):
    k3 = load_source(checkpoint("tiny-k25-dsv32-trained"))
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
    """Same seed, same weights (a 3-step run: the full run is the session fixture above). The uncached
    function runs twice, so the session's cached training (seed 0) stays for the tests that reuse it."""
    monkeypatch.setattr(trained, "STEPS", 3)
    monkeypatch.setitem(trained.RECIPE_OVERRIDES, "tiny-dsv32", {"indexer_steps": 2})  # the distillation too
    train = trained.trained_text_state.__wrapped__
    heard = []
    with trained.reporting(lambda event, **kw: heard.append((event, kw))):
        a, la = train(5)
    b, lb = train(5)
    assert len(la) == 3 and la == lb and all(torch.equal(a[k], b[k]) for k in a)
    # the fixture's progress hears every step with its loss, phase by phase (`kconvert fixture` shows them)
    assert heard[0] == ("start", {"total": 3, "phase": "train on stdlib sources"})
    assert [kw["loss"] for e, kw in heard[1:4]] == list(la) and [kw["n"] for _, kw in heard[1:4]] == [1, 2, 3]
    assert heard[4] == ("start", {"total": 2, "phase": "distil the DSA indexer"}) and len(heard) == 7


def test_fixture_cli_writes_the_trained_preset(checkpoint, tmp_path):
    """`kconvert fixture tiny-k25-dsv32-trained OUT` through the CLI's entry point, in this process so the training
    the session already did is reused (trained.trained_text_state caches it in-process; a new process would
    train again, ~2 minutes): it reports the training and writes the session's checkpoint byte for byte."""
    built = checkpoint("tiny-k25-dsv32-trained")
    out = tmp_path / "tk25"
    r = cli_here("fixture", "tiny-k25-dsv32-trained", out)
    rec = json.loads((built / "kconvert_training.json").read_text())
    assert r.returncode == 0 and f"trained {rec['steps']} steps: loss {rec['loss_first']:.2f} ->" in r.stdout, r
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in built.iterdir())
    for f in built.iterdir():
        assert (out / f.name).read_bytes() == f.read_bytes(), f.name
    assert [p.name for p in tmp_path.iterdir()] == ["tk25"]  # no partial directory left beside it


def test_fixture_cli_reports_training(tmp_path):
    r = cli_here("fixture", "tiny-k25-dsv32-trained", tmp_path / "x", "--seed", "-1")
    assert r.returncode == 2 and "seed" in r.stderr and not (tmp_path / "x").exists()
    assert "tiny-k25-dsv32-trained" in cli_here("fixture", "--help").stdout
