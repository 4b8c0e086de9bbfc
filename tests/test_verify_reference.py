"""`kconvert reference`: what it stores, in both forms, and its bad inputs."""

from __future__ import annotations

import json

import torch

from helpers import assert_one_line_error, run_cli
from kconvert.source.tokenizer import load_kimi_tokenizer
from kconvert.verify.reference import load_reference


def test_reference_full_and_topk(checkpoint, tmp_path):
    src = checkpoint("tiny-k3")
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
