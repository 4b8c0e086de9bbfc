"""What the random-config sweep (bench/random_configs.py, kconvert/fixtures/random_configs) found, each as a test of
the fix: a config a reference runs that kconvert refused or read wrongly, or a config that disagrees with itself and
is now refused in one line naming what disagrees. (DeepSeek-V4.1's roles across layers: tests/families/dsv41/
test_dsv41_forward.py.)"""

from __future__ import annotations

import json

import pytest

from helpers import cli_here, verify_json
from kconvert.fixtures.random_configs import Draw
from kconvert.fixtures.random_configs.deepseek import draw_text
from kconvert.fixtures.random_configs.run import BOUND, run


def _text(model_type: str, **values) -> dict:
    import random

    return {**draw_text(random.Random(0), model_type), **values}


def test_no_shared_expert_as_transformers_saves_it(tmp_path):
    """n_shared_experts 0: transformers (as DeepSeek's own model code) builds the shared expert 0 wide and saves its
    zero-size weights; kconvert refused them as unknown tensors. Now read as stored, nothing built for them."""
    text = _text("deepseek_v3", n_shared_experts=0, num_hidden_layers=2, first_k_dense_replace=1)
    d = Draw("dsv3", 0, {"kconvert_kind": "deepseek_v3", "text": text, "storage": None},
             [{"id": "t", "kind": "short", "text": "the model routes each token to a few experts " * 4}])
    r = run(d, tmp_path / "w")
    assert r.passed, r.line()


def test_kimi_k25_without_q_lora_as_transformers_saves_it(tmp_path):
    """q_lora_rank null: transformers' reverse of MoonViT's wqkv fusion renames a K2.5 text layer's
    `self_attn.q_proj` to `self_wqkv` on save; the kimi_k25 aliases read it back."""
    from kconvert.fixtures.random_configs.deepseek import draw_vision
    import random

    text = _text("deepseek_v3", q_lora_rank=None, num_hidden_layers=1, first_k_dense_replace=0, n_shared_experts=1)
    config = {"kconvert_kind": "kimi_k25", "text": text, "vision": draw_vision(random.Random(1)),
              "projection_layer_norm_eps": 1e-5, "storage": None}
    d = Draw("k25", 0, config, [{"id": "t", "kind": "short", "text": "def route(tokens, experts): return x " * 4}])
    r = run(d, tmp_path / "w", keep=True)
    assert r.passed, r.line()
    names = json.loads((tmp_path / "w" / "src" / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(".self_attn.q_proj." in n for n in names) and not any("self_wqkv" in n for n in names)


def test_dense_layer_spellings_that_disagree_are_one_line(tmp_path):
    """transformers' V3.2 builds each layer from `mlp_layer_types`, DeepSeek's and vLLM's code from
    `first_k_dense_replace`: where the two disagree the config builds two different models, and kconvert says so,
    naming the layer (it answered "tensor not known" before)."""
    from kconvert.fixtures.random_configs import family

    text = _text("deepseek_v32", num_hidden_layers=3, first_k_dense_replace=1,
                 mlp_layer_types=["dense", "sparse", "dense"], n_shared_experts=1)
    src = tmp_path / "src"
    src.mkdir()
    family("dsv32").write({"kconvert_kind": "deepseek_v32", "text": text, "storage": None}, src, 0)
    r = cli_here("inspect", src)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "mlp_layer_types and first_k_dense_replace disagree at layer 2 (dense vs sparse)" in r.stderr
