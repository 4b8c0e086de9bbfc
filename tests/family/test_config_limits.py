"""config.json values are bounded and typed before any work (issue 10, item 3): absurd, mistyped or
inconsistent values end as one line naming config.json and the field (exit 2), quickly, in inspect,
plan and shard; real configs pass; the manifest expression evaluator computes on numbers only."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from helpers import assert_one_line_error, cli_here, run_cli
from kconvert.errors import ManifestError
from kconvert.family.expr import evaluate
from kconvert.family.manifest import bind
from kconvert.plan.memory import make_plan
from kconvert.source.checkpoint import Checkpoint

EXAMPLE = Path(__file__).resolve().parents[2] / "manifests" / "examples" / "k25-dsv32-3t" / "config.json"

# DeepSeek-V3's published config.json (the numbers that shape it), to show real configs stay inside the bounds.
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_nextn_predict_layers": 1, "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
    "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8,
    "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True,
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "rope_theta": 10000, "tie_word_embeddings": False,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
}


def _example() -> dict:
    return json.loads(EXAMPLE.read_text())


def _bind_error(config: dict) -> str:
    with pytest.raises(ManifestError) as e:
        bind(config)
    return e.value.one_line()


def test_real_configs_pass():
    for config in (_example(), DEEPSEEK_V3, {**DEEPSEEK_V3, "q_lora_rank": None}):
        bind(config)  # no error
    model = bind({**DEEPSEEK_V3, "q_lora_rank": None})  # null: no q LoRA, the q_proj form (DeepSeek-V2-Lite style)
    assert any(r.pattern.endswith("self_attn.q_proj.weight") for r in model.text.rules)


@pytest.mark.parametrize("field,value,why", [
    ("num_hidden_layers", 10**9, "outside [1, 1024]"),
    ("n_routed_experts", 10**9, "outside [0, 65536]"),
    ("hidden_size", 10**12, "outside"),
    ("vocab_size", 2**40, "outside"),
    ("max_position_embeddings", 10**12, "outside"),
    ("num_attention_heads", 0, "outside"),
    ("hidden_size", "7168", "must be an integer"),
    ("n_routed_experts", [384] * 1000, "must be an integer"),
    ("num_hidden_layers", 61.0, "must be an integer"),
    ("vocab_size", True, "must be an integer"),
    ("num_hidden_layers", None, "must be an integer"),
    ("kv_lora_rank", {"a": 1}, "must be an integer"),
    ("rms_norm_eps", "1e-6", "must be a finite number"),
    ("routed_scaling_factor", float("inf"), "must be a finite number"),
    ("tie_word_embeddings", "no", "must be true or false"),
])
def test_text_field_out_of_bounds_names_config_and_field(field, value, why):
    config = _example()
    config["text_config"][field] = value
    line = _bind_error(config)
    assert line.startswith("config.json: ") and f"text_config.{field} = " in line and why in line, line


@pytest.mark.parametrize("field,value", [("num_hidden_layers", 10**6), ("merge_kernel_size", [2, 2, 2]),
                                         ("merge_kernel_size", ["2", 2]), ("merge_kernel_size", 2),
                                         ("patch_size", 0), ("hidden_size", "1152")])
def test_vision_field_out_of_bounds(field, value):
    config = _example()
    config["vision_config"][field] = value
    assert f"vision_config.{field} = " in _bind_error(config)


@pytest.mark.parametrize("change,needle", [
    ({"num_experts_per_tok": 2000}, "num_experts_per_tok <= n_routed_experts"),
    ({"first_k_dense_replace": 100}, "first_k_dense_replace = 100: must be an integer in [0, 61]"),  # the schedule first
    ({"n_group": 7}, "n_routed_experts % n_group"),
    ({"num_hidden_layers": 1000, "n_routed_experts": 65536, "n_group": 1}, "expert_instances"),
])
def test_relations_between_fields(change, needle):
    config = _example()
    config["text_config"].update(change)
    assert needle in _bind_error(config)


@pytest.mark.parametrize("block", [[0, 128], [-128, 128], [128], "128", [10**9, 128], [128.5, 128], None, [True, 1]])
def test_weight_block_size_bounds(block):
    config = dict(DEEPSEEK_V3, quantization_config=dict(DEEPSEEK_V3["quantization_config"], weight_block_size=block))
    if block is None:
        bind(config)  # absent block size: the reader's default (128 x 128)
        return
    assert "quantization_config.weight_block_size = " in _bind_error(config)


def test_quantization_config_shapes():
    assert "must be an object" in _bind_error(dict(DEEPSEEK_V3, quantization_config=[1, 2]))
    groups = {"group_0": {"weights": {"num_bits": 4, "group_size": 0}, "targets": ["Linear"]}}
    config = _example()
    config["text_config"]["quantization_config"] = {"quant_method": "compressed-tensors", "config_groups": groups}
    assert "text_config.quantization_config.config_groups.group_0.weights.group_size = 0" in _bind_error(config)
    groups["group_0"]["weights"]["group_size"] = 32
    bind(config)


def test_family_keys_typed():
    assert "architectures must be a list of strings" in _bind_error(dict(DEEPSEEK_V3, architectures=12))
    assert "model_type must be a string" in _bind_error({**DEEPSEEK_V3, "architectures": [], "model_type": [1]})


def test_expressions_take_numbers_only():
    env = {"a": 3, "s": "x" * 10, "lst": [1, 2], "d": {"k": 4}, "z": 0, "big": 2**62, "t": True}
    assert evaluate("a * (a + 1) // 2", env) == 6
    assert evaluate("lst[1] * d.k", env) == 8
    assert evaluate("a if t else 0", env) == 3 and evaluate("t + 1", env) == 2  # bools count as 0/1
    for text in ("s * 100000000", "lst * 100000000", "'ab' * 3", "s", "lst", "d", "a / z", "a // z", "a % z",
                 "big * 4", "lst[5]", "a[0]", "-s", "s < 3", "s and 1"):
        with pytest.raises(ManifestError):
            evaluate(text, env)


def test_checkpoint_and_plan_refuse_before_any_work(checkpoint, copy_checkpoint, tmp_path):
    src = copy_checkpoint(checkpoint("tiny-k25-dsv32"))
    config = json.loads((src / "config.json").read_text())
    config["text_config"]["num_hidden_layers"] = 10**9
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ManifestError, match="text_config.num_hidden_layers"):
        Checkpoint.open(src)
    alone = tmp_path / "cfg"
    alone.mkdir()
    (alone / "config.json").write_text(json.dumps(config))
    t = time.perf_counter()
    with pytest.raises(ManifestError, match="text_config.num_hidden_layers"):
        make_plan(str(alone), tp=8)
    assert time.perf_counter() - t < 30  # a guard against enumerating 10^9 layers, not a speed target


def test_cli_inspect_plan_shard_exit_2(checkpoint, copy_checkpoint, tmp_path):
    src = copy_checkpoint(checkpoint("tiny-k25-dsv32-fp8"))
    config = json.loads((src / "config.json").read_text())
    config["text_config"]["n_routed_experts"] = 10**9
    (src / "config.json").write_text(json.dumps(config))
    for args in (["inspect", src], ["plan", src, "--tp", "2"], ["shard", src, tmp_path / "out", "--tp", "2"]):
        assert_one_line_error(run_cli(*args, timeout=120), "config.json", "text_config.n_routed_experts")
    assert not (tmp_path / "out" / "kconvert.json").exists()
    config["text_config"]["n_routed_experts"] = 16
    qc = config.get("quantization_config") or config["text_config"]["quantization_config"]
    qc["weight_block_size"] = [0, 128]
    (src / "config.json").write_text(json.dumps(config))
    assert_one_line_error(cli_here("inspect", src), "config.json", "weight_block_size")  # inspect's process: above
