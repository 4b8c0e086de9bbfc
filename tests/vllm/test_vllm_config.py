"""config.json as each family's release spells it, read by vLLM's own config classes
(vllm.transformers_utils.config.get_config, in the vLLM environment): an export of every family, and a shard, carry
the keys vLLM reads, with the source's meaning, whatever spelling the source came in (the fixtures are
transformers' `save_pretrained` spellings: V3 without routing keys, V4 with `layer_types` / `mlp_layer_types`)."""

from __future__ import annotations

import pytest

from helpers import cli_here

# family preset -> (vLLM's config class, {attribute of its text config: the value the release spells})
# (vLLM reads deepseek_v32 with its DeepseekV3Config)
EXPECTED = {
    "tiny-dsv3": ("DeepseekV3Config", {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "n_routed_experts": 16}),
    "tiny-dsv32": ("DeepseekV3Config", {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "index_topk": 16}),
    "tiny-k25-dsv3": ("Kimi_K25Config", {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}),
    "tiny-dsv4-wide": ("DeepseekV4Config", {"compress_ratios": [0, 4, 128, 0], "num_hash_layers": 1,
                                            "qk_rope_head_dim": 64, "topk_method": "noaux_tc",
                                            "scoring_func": "sqrtsoftplus", "compress_rope_theta": 160000.0}),
    "tiny-dsv41": ("DeepseekV41Config", {"topk_method": "noaux_tc", "compress_ratios": [0, 2, 2, 2, 1, 1, 1, 1, 0, 0]}),
    "tiny-kimi-k3": ("KimiK3Config", {"num_experts": 16, "attn_res_block_size": 3, "topk_method": "noaux_tc"}),
    "tiny-kimi-linear": ("KimiLinearConfig", {"num_experts": 16, "moe_router_activation_func": "sigmoid"}),
}


@pytest.fixture(scope="session")
def parsed(export, checkpoint, tmp_path_factory):
    """{name: what vLLM's config class holds} for a bf16 export of each family and a shard of V4 (one vLLM process)."""
    from kconvert.verify.vllm_check.check import vllm_configs

    dirs = {p: export(p, "bf16") for p in EXPECTED}
    shard = tmp_path_factory.mktemp("shard") / "dsv4"
    r = cli_here("shard", checkpoint("tiny-dsv4-wide"), shard, "--tp", "1")
    assert r.returncode == 0, r.stderr
    dirs["shard:tiny-dsv4-wide"] = shard
    names = list(dirs)
    attrs = [list(EXPECTED[n.split(":")[-1]][1]) + ["rope_parameters"] for n in names]
    return dict(zip(names, vllm_configs(list(zip(dirs.values(), attrs)))))


@pytest.mark.parametrize("name", list(EXPECTED) + ["shard:tiny-dsv4-wide"])
def test_vllm_reads_the_release_keys(parsed, name):
    got = parsed[name]
    assert "error" not in got, got
    cls, want = EXPECTED[name.split(":")[-1]]
    assert got["class"] == cls, got
    assert {k: got["attributes"][k].get("value") for k in want} == want, got["attributes"]
    if name.endswith("tiny-dsv4-wide"):  # the compressed layers' YaRN, as `rope_scaling` in DeepSeek's spelling
        rope = got["attributes"]["rope_parameters"]["value"]
        assert rope["factor"] == 4.0 and rope["original_max_position_embeddings"] == 1024, rope


def test_kimi_k25_is_named_as_vllm_registers_it(parsed):
    assert parsed["tiny-k25-dsv3"]["architectures"] == ["KimiK25ForConditionalGeneration"]
