"""`kconvert reference`: what it stores, in both forms, and its bad inputs."""

from __future__ import annotations

import json

import torch

from helpers import assert_one_line_error, cli_here, run_cli
from kconvert.source.tokenizer import load_kimi_tokenizer
from kconvert.verify.reference import load_reference


def test_reference_full_and_topk(checkpoint, tmp_path):
    src = checkpoint("tiny-k25-dsv32")
    full, top = tmp_path / "full.safetensors", tmp_path / "top.safetensors"
    run_cli("reference", src, "--out", full, "--hidden-states", check=True)
    run_cli("reference", src, "--out", top, "--top-k", "8", check=True)
    meta, refs, tensors = load_reference(full)
    _, trefs, _ = load_reference(top)
    cfg = json.loads((src / "config.json").read_text())
    topk = cfg["text_config"]["index_topk"]
    kinds = [p["kind"] for p in meta["prompts"]]
    assert {"short", "long", "chat", "image"} <= set(kinds)
    lengths = {p["kind"]: r.tokens.numel() for p, r in zip(meta["prompts"], refs)}
    assert lengths["long"] > 3 * topk > lengths["short"]
    enc = load_kimi_tokenizer(src)
    for p, r, t in zip(meta["prompts"], refs, trefs):
        assert torch.allclose(r.full.logsumexp(-1), torch.zeros(r.tokens.numel()), atol=1e-5)
        vals, ids = r.full.topk(8, dim=-1)
        assert torch.equal(t.topk_ids, ids) and torch.allclose(t.topk_logprobs, vals)
        assert torch.allclose(t.rest_logprob.exp() + vals.exp().sum(-1), torch.ones(len(vals)), atol=1e-5)
        if p["kind"] == "image":
            n = int((r.tokens == cfg["image_token_id"]).sum())
            w, h = p["image"]["width"], p["image"]["height"]
            assert n == (-(-h // 28) * 2) * (-(-w // 28) * 2) // 4  # padded to 28, 2x2 merge
        elif p["kind"] in ("short", "long"):
            assert enc.decode(r.tokens.tolist()) == p["text"]
    n_layers = cfg["text_config"]["num_hidden_layers"]
    assert all(f"prompt.0.hidden.{L}" in tensors for L in range(n_layers + 1))
    assert meta["source_fingerprint"] and meta["family"] == "kimi_k25"


def test_reference_bad_inputs(checkpoint, tmp_path):
    src = checkpoint("tiny-dsv32")
    bad = tmp_path / "p.json"
    bad.write_text("{not json")
    assert_one_line_error(run_cli("reference", src, "--out", tmp_path / "r.safetensors", "--prompts", bad), "p.json")
    img = tmp_path / "img.json"
    img.write_text(json.dumps([{"kind": "image", "text": "x", "image": {"seed": 1, "width": 28, "height": 28}}]))
    assert_one_line_error(run_cli("reference", src, "--out", tmp_path / "r.safetensors", "--prompts", img),
                          "no vision tower")
    assert not (tmp_path / "r.safetensors").exists()


def test_reference_refuses_non_finite_logprobs(checkpoint, copy_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    src = copy_checkpoint(checkpoint("tiny-dsv32"))
    index = json.loads((src / "model.safetensors.index.json").read_text())
    shard = src / index["weight_map"]["model.norm.weight"]
    tensors = load_file(shard)
    tensors["model.norm.weight"] = torch.full_like(tensors["model.norm.weight"], float("nan"))
    save_file(tensors, shard)
    out = tmp_path / "r.safetensors"
    assert_one_line_error(run_cli("reference", src, "--out", out), "non-finite")
    assert not out.exists() and not list(tmp_path.glob(".r.safetensors*"))


def test_earliest_ties_rule():
    from kconvert.verify.reference import EarliestTies

    x = torch.tensor([[0.0, 3.0, 0.0, 0.0, 1.0, 0.0, float("-inf")]])
    with EarliestTies():
        got = x.topk(4, dim=-1).indices
    assert got.tolist() == [[1, 4, 0, 2]]  # the largest, then the earliest of the tied zeros


def test_lossless_conversion_with_three_indexer_heads_passes(monkeypatch, tmp_path):
    """ReLU index scores tie at exactly 0 far more often with 3 heads than with 16: both sides must
    break the ties the same way (earliest positions) for a lossless conversion to PASS."""
    import dataclasses

    from kconvert.fixtures import presets
    from kconvert.fixtures.models.k25_dsv32 import write_model_preset

    spec = presets.MODEL_SPECS["tiny-dsv32"]
    monkeypatch.setitem(presets.MODEL_SPECS, "tiny-dsv32-3h",
                        dataclasses.replace(spec, text={**spec.text, "index_n_heads": 3}))
    src = tmp_path / "src"
    src.mkdir()
    write_model_preset("tiny-dsv32-3h", src, 0)
    ref = tmp_path / "ref.safetensors"
    for args in (("shard", src, tmp_path / "out", "--tp", 2), ("reference", src, "--out", ref)):
        r = cli_here(*args)  # the verify's inputs, made in this process
        assert r.returncode == 0, r.stderr
    r = run_cli("verify", tmp_path / "out", "--reference", ref, "--json")
    rep = json.loads(r.stdout)
    assert r.returncode == 0 and rep["verdict"] == "PASS", r.stdout + r.stderr
    assert rep["faithfulness"]["overall"]["mean_kld"] < 1e-6
