"""`kconvert plan` on the bundled DeepSeek-V4 example configs (released shapes and schedules)."""

from __future__ import annotations

import json

from helpers import assert_one_line_error, cli_here
from kconvert.plan.kv_bytes import kv_bytes
from kconvert.plan.memory import make_plan


def test_plan_flash_and_pro_examples():
    for example, tp in (("deepseek-v4-flash", 8), ("deepseek-v4-pro", 16)):
        proc = cli_here("plan", example, "--tp", tp, "--json")
        assert proc.returncode == 0, proc.stderr
        plan = json.loads(proc.stdout)
        assert plan["params"]["compressor"] > 0 and plan["params"]["mhc"] > 0


def test_tp_must_keep_wo_a_groups_whole():
    assert_one_line_error(cli_here("plan", "deepseek-v4-flash", "--tp", "16"), "wo_a.weight",
                          "1024-wide groups over 16 ranks", "tp degrees that work: 1, 2, 4, 8")


def test_pro_tp16_fp8_warns_on_shared_experts():
    proc = cli_here("plan", "deepseek-v4-pro", "--tp", "16", "--quant", "fp8")
    assert proc.returncode == 0, proc.stderr
    assert "shared_experts.w1.weight" in proc.stdout and "192-wide" in proc.stdout


def test_kv_bytes_per_token_follow_the_schedule():
    from kconvert.family.manifest import manifests_dir

    pro = json.loads((manifests_dir() / "examples" / "deepseek-v4-pro" / "config.json").read_text())
    rates = pro["compress_ratios"][:61]
    csa, hca = rates.count(4), rates.count(128)
    assert (csa, hca) == (30, 31)
    bf16 = kv_bytes(pro, "bf16")
    assert bf16.latent_bytes == -(-(csa * 1024 / 4 + hca * 1024 / 128) // 61)  # 2 B x 512 per entry
    assert bf16.indexer_bytes == -(-(csa * 256 / 4) // 61)
    fp8 = kv_bytes(pro, "fp8-ds")  # vLLM's fp8_ds_mla entry: 584 B; indexer key 132 B
    assert fp8.latent_bytes == -(-(csa * 584 / 4 + hca * 584 / 128) // 61)
    assert fp8.indexer_bytes == -(-(csa * 132 / 4) // 61)


def test_plan_reads_params_by_component():
    plan = make_plan("deepseek-v4-flash", 8).to_json()
    params = plan.get("params") or {}
    for c in ("attention", "compressor", "indexer", "mhc", "hash_router", "routed_experts"):
        assert params.get(c, 0) > 0, (c, params)


def test_auto_quant_follows_what_the_device_runs():
    """The device preset says which formats its kernels run: V4's FP4 experts become NVFP4 (cast exactly, as NVIDIA's
    V4 NVFP4 builds) on Blackwell (B200, B300), FP8 (exactly) on Hopper and MUSA S5000, int8 where there is no FP8;
    a bf16 source stays unquantized where the family has no NVFP4 recipe."""
    picks = {d: make_plan("deepseek-v4-flash", 8, quant="auto", device=d)
             for d in ("B200", "B300", "H200", "S5000", "A100")}
    assert {d: p.quant for d, p in picks.items()} == {"B200": "nvfp4", "B300": "nvfp4", "H200": "fp8", "S5000": "fp8",
                                                      "A100": "int8"}
    assert "re-encoded as FP8 exactly" in picks["H200"].quant_reason
    assert "cast to it exactly" in picks["B200"].quant_reason
    assert picks["B200"].converted_bytes < 0.6 * picks["H200"].converted_bytes  # experts at half a byte and a bit
    assert make_plan("deepseek-v4-flash", 8, quant="fp4", device="B200").converted_bytes < \
        picks["B200"].converted_bytes  # NVFP4's e4m3 scale per 16 against MXFP4's e8m0 per 32
    assert make_plan("k25-dsv32-3t", 8, quant="auto", device="H200").quant == "none"  # a bf16 config stays bf16
    assert "no FP4 kernels" in " ".join(make_plan("deepseek-v4-flash", 8, quant="fp4", device="H200").warnings)
    assert "no NVFP4 tensor cores" in " ".join(make_plan("deepseek-v4-flash", 8, quant="nvfp4", device="H200").warnings)


def test_plan_sizes_v4_kv_with_the_exact_formula():
    """The KV at --context and the largest context that fits use the per-layer formula (entries per rate, plus each
    layer's sliding window and compressor state per sequence), not an average per token. (Batch 16: memory, not
    the model's 1M max_position_embeddings, binds.)"""
    context, batch = 300_001, 16
    plan = make_plan("deepseek-v4-flash", 8, context=context, batch=batch, kv_dtype="fp8").to_json()
    kv = kv_bytes(json.loads(_example("deepseek-v4-flash")), "fp8")
    mem = plan["memory"]
    assert mem["kv_bytes"] == batch * kv.context_bytes(context) != batch * context * kv.per_token
    free, n = mem["headroom_bytes"] + mem["kv_bytes"], mem["max_context"]
    assert batch * kv.context_bytes(n) <= free < batch * kv.context_bytes(n + 1)  # the largest that fits
    assert plan["kv_cache"]["bytes_per_sequence"] == kv.per_sequence > 0


def test_largest_context_stops_at_max_position_embeddings():
    """Issue 42: at batch 1 an H200 node holds more than 1M tokens of V4-Flash's KV, but the model reads at most
    its max_position_embeddings: the plan's largest context (every table of it) stops there."""
    plan = make_plan("deepseek-v4-flash", 8, batch=1, kv_dtype="fp8").to_json()
    top = json.loads(_example("deepseek-v4-flash"))["max_position_embeddings"]
    mem = plan["memory"]
    assert mem["headroom_bytes"] + mem["kv_bytes"] > 2 * kv_bytes(json.loads(_example("deepseek-v4-flash")),
                                                                  "fp8").context_bytes(top)  # memory would give more
    assert mem["max_context"] == top
    assert all(o["max_context"] <= top and o["tiered_max_context"] <= top for o in plan["kv_options"])
    assert all(d["max_context"] is None or d["max_context"] <= top for d in plan["devices"] + plan["tp_table"])


def _example(name: str) -> str:
    from kconvert.family.manifest import manifests_dir

    return (manifests_dir() / "examples" / name / "config.json").read_text()

