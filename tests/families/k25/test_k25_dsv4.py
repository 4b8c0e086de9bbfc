"""Kimi-K2.5's MoonViT + projector over DeepSeek-V4 text, as transformers builds it
(Kimi_K25ForConditionalGeneration with a deepseek_v4 text config). The kimi_k25 family takes the V4 text
parts (no copy of the V4 manifest), transformers loads the names kconvert reads, and conversions at tp 2
and tp 2 x pp 2 match transformers on text and image prompts, on a V4 text config that is not a preset."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from helpers import ROOT, cli_here, one_thread
from kconvert.family.engine_names import engine_name
from kconvert.fixtures.models.k25_dsv4 import build_k25_dsv4_model, write_k25_dsv4_model
from kconvert.source.checkpoint import Checkpoint

# not the preset's text: other attention kinds per layer, rates, window, streams and top-k
HELD_OUT = {"layer_types": ["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention",
                            "compressed_sparse_attention"],
            "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
            "sliding_window": 16, "hc_mult": 2, "index_topk": 2, "o_groups": 4, "o_lora_rank": 32}


@pytest.fixture(scope="module")
def k25_dsv4(tmp_path_factory):
    d = tmp_path_factory.mktemp("k25_dsv4")
    src = d / "src"
    src.mkdir()
    model = build_k25_dsv4_model(7, HELD_OUT)
    write_k25_dsv4_model(model, src)
    for args in (("shard", src, d / "tp2", "--tp", 2), ("shard", src, d / "pp", "--tp", 2, "--pp", 2),
                 ("reference", src, "--out", d / "ref.safetensors", "--hidden-states")):
        r = cli_here(*args)
        assert r.returncode == 0, r.stderr
    return d, model


def test_kimi_family_takes_the_v4_text_parts(k25_dsv4):
    d, _ = k25_dsv4
    ck = Checkpoint.open(d / "src")
    ck.validate()  # every stored tensor known, every expected one present
    assert ck.family == "kimi_k25" and {p.name for p in ck.model.parts} == {
        "deepseek_v4_model", "deepseek_v4_block", "moonvit", "kimi_projector"}
    assert ck.model.family["engine"]["block"] == "mhc"  # the V4 text part's traits, laid over Kimi's
    assert engine_name(ck.model, "language_model.model.layers.1.attn.wq_a.weight") == \
        "language_model.model.layers.1.self_attn.q_a_proj.weight"
    assert engine_name(ck.model, "language_model.lm_head.weight") == "language_model.lm_head.weight"
    assert engine_name(ck.model, "vision_tower.encoder.blocks.0.wqkv.weight") == "vision_tower.encoder.blocks.0.wqkv.weight"


def test_transformers_loads_the_names_kconvert_reads(k25_dsv4):
    from transformers.models.kimi_k25 import Kimi_K25ForConditionalGeneration

    d, model = k25_dsv4
    loaded, info = Kimi_K25ForConditionalGeneration.from_pretrained(d / "src", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    want = model.state_dict()
    assert all(torch.equal(want[k].float(), v.float()) for k, v in loaded.state_dict().items())


@pytest.mark.parametrize("layout", ["tp2", "pp"])
def test_conversions_match_transformers_on_text_and_images(k25_dsv4, layout):
    d, _ = k25_dsv4
    with one_thread():
        r = cli_here("verify", d / layout, "--reference", d / "ref.safetensors", "--json")
    rep = json.loads(r.stdout)
    assert r.returncode == 0 and rep["verdict"] == "PASS", r.stderr
    assert rep["cost"]["overall"]["mean_kld"] < 1e-5 and "image" in rep["cost"]["by_kind"], rep["cost"]
    assert rep["cost"]["by_kind"]["image"]["mean_kld"] < 1e-5


def test_chat_answers_about_an_image(k25_dsv4, image_file):
    d, _ = k25_dsv4
    p = subprocess.run([sys.executable, "-m", "engine.chat", str(d / "tp2"), "--prompt", "What is in this picture?",
                        "--image", str(image_file), "--max-new-tokens", "8"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    assert "8 tokens" in p.stdout.strip().splitlines()[-1], p.stdout


def test_transformers_save_pretrained_of_kimi_over_v4_reads_as_published(k25_dsv4, tmp_path):
    """A Kimi-over-V4 checkpoint written by transformers' save_pretrained (`blocks`, and `attn.norm` for the
    attention's kv_norm) is read through the kimi_k25 manifest's aliases as the published names."""
    _, model = k25_dsv4
    model.save_pretrained(tmp_path / "saved")
    ck = Checkpoint.open(tmp_path / "saved")
    ck.validate()
    assert "language_model.model.layers.1.attn.kv_norm.weight" in ck.logical
