"""The deepseek_v4 family: released names, per-layer schedules (compress_ratios / layer_types,
num_hash_layers / mlp_layer_types), MTP blocks, limits, and refusals that are one line."""

from __future__ import annotations

import copy
import json

import pytest

from helpers import assert_one_line_error, cli_here
from kconvert.errors import ManifestError
from kconvert.family.manifest import bind

BASE = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": 1024, "hidden_size": 64,
    "moe_intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 64, "qk_rope_head_dim": 16, "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 16,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "hc_mult": 4, "sliding_window": 8,
    "index_n_heads": 2, "index_head_dim": 32, "index_topk": 4, "num_nextn_predict_layers": 1,
    "compress_ratios": [0, 4, 128, 4, 0], "num_hash_layers": 1,
}


def names(config: dict) -> dict[str, tuple]:
    mm = bind(config)
    return {i.name: (i.component, i.split, i.expected_shape()) for i, _ in mm.expected(include_optional=True)}


def test_released_names_components_and_split_rules():
    n = names(BASE)
    # every layer: MQA with sinks, grouped output, mHC
    assert n["layers.0.attn.wq_b.weight"] == ("attention", "col", (4 * 64, 32))
    assert n["layers.0.attn.wo_a.weight"] == ("attention", "col", (2 * 16, 4 * 64 // 2))
    assert n["layers.0.attn.wo_b.weight"] == ("attention", "row", (64, 2 * 16))
    assert n["layers.0.attn.attn_sink"] == ("attention", "col", (4,))
    for rep in ("attn.wq_a.weight", "attn.wkv.weight", "hc_attn_fn", "hc_ffn_base"):
        assert n[f"layers.0.{rep}"][1] == "replicate"
    assert n["layers.0.hc_attn_fn"] == ("mhc", "replicate", ((2 + 4) * 4, 4 * 64))
    assert n["hc_head_fn"] == ("mhc", "replicate", (4, 4 * 64)) and n["hc_head_scale"][2] == (1,)
    # layer 0 sliding only; 1 and 3 CSA (compressor 2x wide + indexer); 2 HCA (no indexer)
    assert not any(k.startswith("layers.0.attn.compressor") for k in n)
    assert n["layers.1.attn.compressor.wkv.weight"] == ("compressor", "replicate", (2 * 64, 64))
    assert n["layers.1.attn.compressor.ape"][2] == (4, 2 * 64)
    assert n["layers.1.attn.indexer.wq_b.weight"] == ("indexer", "replicate", (2 * 32, 32))
    assert n["layers.1.attn.indexer.compressor.ape"][2] == (4, 2 * 32)
    assert n["layers.2.attn.compressor.ape"][2] == (128, 64)
    assert not any(k.startswith("layers.2.attn.indexer") for k in n)
    # hash routing on layer 0 only: tid2eid and no bias there, a bias elsewhere
    assert n["layers.0.ffn.gate.tid2eid"] == ("hash_router", "replicate", (1024, 2))
    assert "layers.0.ffn.gate.bias" not in n and "layers.1.ffn.gate.tid2eid" not in n
    assert n["layers.1.ffn.gate.bias"][0] == "router"
    assert n["layers.3.ffn.experts.3.w2.weight"] == ("routed_experts", "expert", (64, 32))
    assert n["layers.3.ffn.shared_experts.w2.weight"][:2] == ("shared_experts", "row")
    # the MTP block: mtp.0.*, a sliding block (compress_ratios' trailing 0) with its own projections and hc head
    assert n["mtp.0.attn.wq_a.weight"][0] == "mtp" and n["mtp.0.e_proj.weight"][2] == (64, 64)
    assert n["mtp.0.hc_head_base"][2] == (4,) and n["mtp.0.ffn.experts.0.w1.weight"][2] == (32, 64)
    assert not any(k.startswith("mtp.0.attn.compressor") or k.startswith("layers.4.") for k in n)


def test_unknown_and_misplaced_names_are_not_classified():
    mm = bind(BASE)
    for name in ("layers.0.attn.wq_c.weight", "layers.4.attn.wq_a.weight", "mtp.1.attn.wq_a.weight",
                 "layers.1.ffn.gate.tid2eid", "layers.0.attn.compressor.ape", "model.layers.0.attn.wq_a.weight"):
        assert mm.classify(name) is None, name
    info = mm.classify("mtp.0.ffn.experts.3.w3.weight")
    assert (info.layer, info.expert, info.component) == (4, 3, "mtp")


def test_layer_types_and_compress_ratios_read_alike():
    spelled = {k: v for k, v in BASE.items() if k not in ("compress_ratios", "num_hash_layers")}
    spelled["layer_types"] = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                              "compressed_sparse_attention"]
    spelled["mlp_layer_types"] = ["hash_moe", "moe", "moe", "moe"]
    assert names(spelled) == names(BASE)
    both = {**BASE, **spelled}
    assert names(both) == names(BASE)


def test_transformers_compress_rates_give_the_ape_shape():
    cfg = {**BASE, "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
           "compress_ratios": [0, 4, 8, 4, 0]}
    assert names(cfg)["layers.2.attn.compressor.ape"][2] == (8, 64)


@pytest.mark.parametrize("change,needles", [
    ({"compress_ratios": [0, 4, 128, 4]}, ["compress_ratios has 4 entries, needs 5"]),
    ({"compress_ratios": [0, 4, 128, 4, 0, 0]}, ["compress_ratios has 6 entries, needs 5"]),
    ({"compress_ratios": [0, 4, 7, 4, 0]}, ["compress_ratios[2] = 7"]),
    ({"compress_ratios": [0, 4, True, 4, 0]}, ["compress_ratios[2] = True"]),
    ({"compress_ratios": None}, ["no compress_ratios or layer_types"]),
    ({"layer_types": ["sliding_attention"] * 4}, ["compress_ratios and layer_types disagree at layer 1"]),
    ({"num_hash_layers": 9}, ["num_hash_layers = 9", "[0, 5]"]),  # the schedule's count, before the relation
    ({"num_hash_layers": None}, ["no num_hash_layers or mlp_layer_types"]),
    ({"o_groups": 3}, ["num_attention_heads % o_groups"]),
    ({"hc_mult": 10**6}, ["hc_mult = 1000000: outside"]),
])
def test_bad_schedules_and_bounds_are_one_named_error(change, needles):
    cfg = {k: v for k, v in {**BASE, **change}.items() if v is not None}
    with pytest.raises(ManifestError) as e:
        bind(cfg, config_file="src/config.json")
    line = e.value.one_line()
    assert "\n" not in line and line.startswith("src/config.json: ")
    for n in needles:
        assert n in line, line


def test_fixture_config_agrees_in_both_spellings(checkpoint):
    config = json.loads((checkpoint("tiny-dsv4") / "config.json").read_text())
    assert config["compress_ratios"] == [0, 4, 8, 4, 0] and config["num_hash_layers"] == 2
    assert config["layer_types"][2] == "heavily_compressed_attention"
    bind(config)  # both spellings present, and they agree


def test_wrong_compress_ratios_length_is_one_line_at_the_cli(checkpoint, copy_checkpoint, tmp_path):
    src = copy_checkpoint(checkpoint("tiny-dsv4"))
    config = json.loads((src / "config.json").read_text())
    config["compress_ratios"] = config["compress_ratios"][:-1]
    (src / "config.json").write_text(json.dumps(config))
    assert_one_line_error(cli_here("inspect", src), "config.json", "compress_ratios has 4 entries, needs 5")
    out = tmp_path / "out"
    assert_one_line_error(cli_here("shard", src, out, "--tp", "1"), "compress_ratios has 4 entries")
    assert not out.exists()


def test_neither_spelling_falls_back_to_no_default():
    cfg = copy.deepcopy(BASE)
    del cfg["compress_ratios"]
    with pytest.raises(ManifestError, match="a default would not be the released schedule"):
        bind(cfg)
