"""Kimi Linear (Kimi-Linear-48B's architecture) against transformers 5.23's KimiLinearForCausalLM, the second
reference of the KDA, NoPE MLA and MoE that Kimi K3 shares: on a config that is not the preset, transformers loads
the fixture strictly, and conversions at tp 1, tp 2 and tp 2 x pp 2 give its log-probs; a checkpoint written by
transformers' own save_pretrained (its dense layers spelled `block_sparse_moe.`) converts and verifies too."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import cli_here, one_thread
from kconvert.fixtures.models.kimi_k3 import kimi_linear_config, write_kimi_checkpoint

OTHER = {"num_hidden_layers": 4, "hidden_size": 192, "intermediate_size": 320, "num_attention_heads": 2,
         "num_key_value_heads": 2, "q_lora_rank": 64, "kv_lora_rank": 96, "qk_nope_head_dim": 48,
         "qk_rope_head_dim": 16, "v_head_dim": 32, "num_experts": 8, "num_experts_per_token": 2,
         "num_shared_experts": 2, "moe_intermediate_size": 96, "routed_scaling_factor": 1.5,
         "linear_attn_config": {"num_heads": 2, "head_dim": 96, "short_conv_kernel_size": 4,
                                "kda_layers": [1, 3], "full_attn_layers": [2, 4]}}


@pytest.fixture(scope="module")
def kl(tmp_path_factory):
    d = tmp_path_factory.mktemp("kimilinear")
    src = d / "src"
    src.mkdir()
    write_kimi_checkpoint(src, kimi_linear_config(OTHER), seed=5, storage="bf16")
    for args in (("shard", src, d / "tp1", "--tp", 1), ("shard", src, d / "tp2", "--tp", 2),
                 ("shard", src, d / "tp2pp2", "--tp", 2, "--pp", 2),
                 ("reference", src, "--out", d / "ref.safetensors", "--hidden-states")):
        r = cli_here(*args)
        assert r.returncode == 0, r.stderr
    return d


def test_transformers_loads_the_fixture_strictly(kl):
    from transformers import KimiLinearForCausalLM

    _, info = KimiLinearForCausalLM.from_pretrained(str(kl / "src"), dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info


@pytest.mark.parametrize("layout", ["tp1", "tp2", "tp2pp2"])
def test_conversions_give_transformers_log_probs(kl, layout):
    with one_thread():
        r = cli_here("verify", kl / layout, "--reference", kl / "ref.safetensors", "--per-layer", "--json")
    rep = json.loads(r.stdout)
    assert r.returncode == 0 and rep["verdict"] == "PASS", r.stderr
    assert rep["cost"]["overall"]["mean_kld"] < 1e-5 and rep["fault_at"] is None


def test_a_checkpoint_transformers_saved_converts_and_verifies(kl, tmp_path):
    """transformers' save_pretrained writes the dense layer's MLP as `block_sparse_moe.*` (its load-time renaming
    run backwards): the family's aliases read it as released, and its conversion gives its own log-probs."""
    from transformers import KimiLinearForCausalLM

    saved = tmp_path / "saved"
    KimiLinearForCausalLM.from_pretrained(str(kl / "src"), dtype=torch.float32).save_pretrained(saved)  # nothing rounded
    for f in ("tiktoken.model", "tokenizer_config.json", "special_tokens_map.json"):
        (saved / f).write_bytes((kl / "src" / f).read_bytes())
    names = json.loads((saved / "model.safetensors.index.json").read_text())["weight_map"] if \
        (saved / "model.safetensors.index.json").exists() else None
    if names is not None:
        assert any(".block_sparse_moe.gate_proj." in n for n in names)
    r = cli_here("shard", saved, tmp_path / "conv", "--tp", 2)
    assert r.returncode == 0, r.stderr
    with one_thread():
        # the same weights saved again: another source fingerprint, the same log-probs
        r = cli_here("verify", tmp_path / "conv", "--reference", kl / "ref.safetensors", "--json", "--force")
    assert r.returncode == 0 and json.loads(r.stdout)["cost"]["overall"]["mean_kld"] < 1e-5, r.stderr
