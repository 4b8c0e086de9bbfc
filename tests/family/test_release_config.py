"""config.json in the release's spelling (kconvert/family/release_config.py, from each family's manifest): what an
export and a shard write, whatever spelling the source came in, parsed by transformers' own config classes to the
source's meaning. (vLLM's config classes read the same files in tests/vllm/test_vllm_config.py.)"""

from __future__ import annotations

import json

import pytest

from helpers import cli_here
from kconvert.errors import CheckpointError
from kconvert.family.manifest import bind
from kconvert.family.release_config import release_config

TRANSFORMERS_ONLY = ("layer_types", "mlp_layer_types", "rope_parameters", "partial_rotary_factor")


def exported_config(src, out) -> dict:
    r = cli_here("export", src, out, "--format", "bf16")
    assert r.returncode == 0, r.stderr
    return json.loads((out / "config.json").read_text())


def test_v3_gets_the_routing_keys_transformers_drops(checkpoint, tmp_path):
    src = checkpoint("tiny-dsv3")
    assert "topk_method" not in json.loads((src / "config.json").read_text())  # as save_pretrained writes it
    config = exported_config(src, tmp_path / "bf16")
    assert (config["topk_method"], config["scoring_func"]) == ("noaux_tc", "sigmoid")
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(tmp_path / "bf16")
    assert type(hf).__name__ == "DeepseekV3Config" and hf.n_routed_experts == 16


def test_v32_and_kimi_linear_exports_parse_in_transformers(checkpoint, tmp_path):
    from transformers import AutoConfig

    for preset, cls in (("tiny-dsv32", "DeepseekV32Config"), ("tiny-kimi-linear", "KimiLinearConfig")):
        config = exported_config(checkpoint(preset), tmp_path / preset)
        hf = AutoConfig.from_pretrained(tmp_path / preset)
        assert type(hf).__name__ == cls and hf.num_hidden_layers == config["num_hidden_layers"]
        if preset == "tiny-dsv32":
            assert (config["topk_method"], config["scoring_func"]) == ("noaux_tc", "sigmoid")


def test_a_source_routing_key_is_kept_as_the_source_says():
    config = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 2,
              "scoring_func": "softmax", "n_routed_experts": 8}
    out = release_config(config, bind(config).family)
    assert (out["scoring_func"], out["topk_method"]) == ("softmax", "noaux_tc")


@pytest.mark.parametrize("preset", ["tiny-dsv4", "tiny-dsv4-wide"])
def test_v4_is_written_in_deepseeks_spelling_with_the_sources_meaning(checkpoint, tmp_path, preset):
    from transformers import DeepseekV4Config

    src = checkpoint(preset)
    source = json.loads((src / "config.json").read_text())
    config = exported_config(src, tmp_path / "bf16")
    assert not set(TRANSFORMERS_ONLY) & set(config), config
    rates = {"sliding_attention": 0, **source["compress_rates"]}
    assert config["compress_ratios"] == [rates[k] for k in source["layer_types"]] + [0]  # + the MTP block's 0
    assert config["num_hash_layers"] == source["mlp_layer_types"].count("hash_moe")
    assert config["topk_method"] == "noaux_tc" and config["rope_scaling"]["type"] == "yarn"
    # compress_rates stays only where its rates are not the release's (tiny-dsv4's HCA rate is 8)
    assert ("compress_rates" in config) == (source["compress_rates"]["heavily_compressed_attention"] != 128)
    if "compress_rates" not in config:  # transformers reads DeepSeek's spelling for the release's rates only
        ours, theirs = DeepseekV4Config(**config), DeepseekV4Config(**source)
        for key in ("layer_types", "mlp_layer_types", "partial_rotary_factor", "qk_rope_head_dim"):
            assert getattr(ours, key) == getattr(theirs, key), key
        for kind in ("main", "compress"):  # (DeepSeek's `type` key rides along beside transformers' `rope_type`)
            assert {k: v for k, v in ours.rope_parameters[kind].items() if k != "type"} == theirs.rope_parameters[kind]


def test_shard_writes_the_release_spelling_too(checkpoint, tmp_path):
    r = cli_here("shard", checkpoint("tiny-dsv4-wide"), tmp_path / "s", "--tp", "1")
    assert r.returncode == 0, r.stderr
    config = json.loads((tmp_path / "s" / "config.json").read_text())
    assert config["compress_ratios"] == [0, 4, 128, 0] and "mlp_layer_types" not in config


def test_kimi_k25_is_named_as_moonshot_ships_it(checkpoint, tmp_path):
    from transformers import AutoConfig

    config = exported_config(checkpoint("tiny-k25-dsv3"), tmp_path / "bf16")
    assert config["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert config["text_config"]["topk_method"] == "noaux_tc"
    assert type(AutoConfig.from_pretrained(tmp_path / "bf16")).__name__ == "Kimi_K25Config"


def test_hash_layers_deepseek_cannot_spell_are_refused(checkpoint, copy_checkpoint, tmp_path):
    config = {"model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"], "num_hidden_layers": 3,
              "layer_types": ["sliding_attention"] * 3, "mlp_layer_types": ["moe", "hash_moe", "moe"],
              "head_dim": 512, "qk_rope_head_dim": 64}
    with pytest.raises(CheckpointError, match="num_hash_layers counts the first N"):
        release_config(config, {"release_text_config": {"spelling": "deepseek_v4"}})
    src = copy_checkpoint(checkpoint("tiny-dsv4"))  # hash routing on layers 0 and 1: moved to 0 and 2
    config = json.loads((src / "config.json").read_text())
    config["mlp_layer_types"] = ["hash_moe", "moe", "hash_moe", "moe"]
    (src / "config.json").write_text(json.dumps(config))
    for cmd in (["export", src, tmp_path / "e", "--format", "bf16"], ["shard", src, tmp_path / "s", "--tp", "1"]):
        r = cli_here(*cmd)
        assert r.returncode == 2 and "num_hash_layers" in r.stderr and r.stderr.count("\n") == 1, r.stderr
        assert not list(tmp_path.glob(f"{cmd[2].name}/*.safetensors")), cmd  # refused before any work


def test_families_released_in_their_own_spelling_are_left_as_they_are(checkpoint):
    for preset in ("tiny-kimi-k3", "tiny-kimi-linear"):
        config = json.loads((checkpoint(preset) / "config.json").read_text())
        assert release_config(config, bind(config).family) == config
