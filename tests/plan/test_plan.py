"""`kconvert plan`: bytes per rank, KV cache per token, fit verdicts (config and headers only)."""

from __future__ import annotations

import json

import pytest

from cli.main import main
from cli.plan_cmd import parse_tokens
from kconvert.errors import UsageError
from kconvert.family.manifest import manifests_dir
from kconvert.plan.device_presets import GIB, devices, find_device
from kconvert.plan.memory import default_reserve, make_plan

BIG = "k25-dsv32-3t"  # manifests/examples/k25-dsv32-3t/config.json, found by name
EXAMPLE_CONFIG = manifests_dir() / "examples" / BIG / "config.json"
M = 1 << 20


def test_example_config_is_about_3t_and_a_kimi_k25_with_dsa():
    p = make_plan(BIG, 8, quant="none")
    assert p.family == "kimi_k25" and p.source_kind == "config"
    assert abs(p.total_params - 3e12) / 3e12 < 0.03, p.total_params
    assert p.model["max_position_embeddings"] == M and p.model["index_head_dim"] == 128
    assert p.params["vision"] > 0 and p.params["projector"] > 0 and p.params["indexer"] > 0
    # bf16 source: every tensor 2 bytes except the fp32 e_score_correction_bias (61 - 1 moe layers x 1152)
    assert p.converted_bytes == 2 * p.total_params + 2 * 60 * 1152
    # the same config given as a file or as its directory
    assert make_plan(str(EXAMPLE_CONFIG), 8).rank == make_plan(str(EXAMPLE_CONFIG.parent), 8).rank == p.rank


def test_fp8_halves_the_quantized_part_and_keeps_the_rest():
    none, fp8 = make_plan(BIG, 8, quant="none"), make_plan(BIG, 8, quant="fp8")
    a, b = none.rank["bytes"], fp8.rank["bytes"]
    for comp in ("routed_experts", "shared_experts", "dense_mlp"):
        assert b[comp] / a[comp] == pytest.approx(0.5, abs=0.002)  # e4m3 + one fp32 scale per 128x128 block
    assert b["attention"] / a["attention"] == pytest.approx(0.5, abs=0.01)  # its small norms stay bf16
    for comp in ("embed", "head", "norm", "router", "vision", "projector"):
        assert b[comp] == a[comp]  # kept in high precision by the manifest
    assert 0.49 < fp8.rank["total"] / none.rank["total"] < 0.51


@pytest.mark.parametrize("quant", ["none", "fp8", "int8", "int4"])
def test_ranks_add_up_to_the_converted_model_plus_replicas(quant):
    p = make_plan(BIG, 8, quant=quant)
    assert p.rank["total"] == p.rank["min_total"]  # 1152 experts divide evenly: ranks are equal
    # int8: a row-split tensor (61 o_proj, 60 shared-expert down_proj, 1 dense down_proj) keeps all
    # its [hidden, 1] float32 scales on every rank
    extra = 7 * 4 * 7168 * (61 + 60 + 1) if quant == "int8" else 0
    assert 8 * p.rank["total"] == p.converted_bytes + 7 * p.replicated_bytes + extra
    by_tp = {r["tp"]: r["weights_per_rank"] for r in p.tp_table}
    assert by_tp[8] == p.rank["total"] and all(r["ok"] for r in p.tp_table)
    assert by_tp[1] == p.converted_bytes and by_tp[64] < by_tp[32] < by_tp[16] < by_tp[8]
    # 144 whole experts per rank at ep 8: routed_experts per rank = 1/8 of them all
    assert p.rank["bytes"]["routed_experts"] * 8 == make_plan(BIG, 1, quant=quant).rank["bytes"]["routed_experts"]


def test_ep_1_splits_every_expert_and_flags_unaligned_fp8_slices():
    whole, split = make_plan(BIG, 8, quant="fp8"), make_plan(BIG, 8, ep=1, quant="fp8")
    assert split.layout == {"tp": 8, "ep": 1, "expert_tp": 8}
    assert split.rank["bytes"]["routed_experts"] == pytest.approx(whole.rank["bytes"]["routed_experts"], rel=1e-3)
    assert not split.warnings  # 2048 / 8 = 256 rows per rank: block-aligned
    narrow = make_plan(BIG, 64, ep=1, quant="fp8")  # 2048 / 64 = 32 rows: scale blocks straddle ranks
    assert any("not 128-aligned" in w for w in narrow.warnings)


def test_kv_bytes_per_token_by_hand():
    layers, kv_lora, rope, index_dim = 61, 512, 64, 128
    ds = make_plan(BIG, 8, quant="fp8", kv_dtype="fp8-ds").kv_cache
    assert ds["latent_bytes"] == kv_lora + 4 * (kv_lora // 128) + 2 * rope == 656  # FlashMLA fp8 layout
    assert ds["indexer_bytes"] == index_dim + 4 == 132  # vLLM's fp8 indexer cache
    assert ds["bytes_per_token"] == layers * (656 + 132)
    fp8 = make_plan(BIG, 8, quant="fp8", kv_dtype="fp8").kv_cache  # the fp8 latent, bf16 indexer keys
    assert (fp8["latent_bytes"], fp8["indexer_bytes"]) == (656, 2 * index_dim)
    bf16 = make_plan(BIG, 8, kv_dtype="bf16").kv_cache
    assert bf16["bytes_per_token"] == layers * 2 * (kv_lora + rope + index_dim)
    # replicated under DeepSeek's TP layout: the same per rank at every tp
    assert make_plan(BIG, 64, kv_dtype="bf16").kv_cache == bf16


def test_memory_arithmetic_and_reserve():
    p = make_plan(BIG, 64, quant="fp8", device="h200", context=128 * 1024, batch=2, kv_dtype="fp8")
    m, kv = p.memory, p.kv_cache["bytes_per_token"]
    assert m["device"] == "H200" and m["usable_bytes"] == int(find_device("H200").memory_bytes * 0.92)
    assert m["reserve_bytes"] == default_reserve(7168) == 2 * GIB + 8192 * 7168 * 2 * 24
    assert m["kv_bytes"] == 2 * 128 * 1024 * kv
    free = m["usable_bytes"] - m["weights_bytes"] - m["reserve_bytes"]
    assert m["headroom_bytes"] == free - m["kv_bytes"] and m["fits"]
    assert m["max_context"] == free // (2 * kv)
    q = make_plan(BIG, 64, quant="fp8", device="H200", context=128 * 1024, batch=2, kv_dtype="fp8", reserve_gb=10)
    assert q.memory["reserve_bytes"] == 10 * GIB and q.memory["max_context"] < m["max_context"]


def test_verdicts_follow_ranks_devices_and_context():
    # 3T in fp8 is ~360 GiB per rank at tp 8: no single accelerator holds that
    p = make_plan(BIG, 8, quant="fp8", device="H100", context=128 * 1024, kv_dtype="fp8")
    assert not p.memory["fits"] and p.memory["max_context"] == 0 and p.memory["headroom_bytes"] < 0
    assert not any(d["fits"] for d in p.devices)
    # ... but 64 ranks of 80 GB hold it at 128K, and the tp table says which degree is the first that fits
    fits = {r["tp"]: r["fits"] for r in p.tp_table}
    assert fits[64] and not fits[16]
    assert make_plan(BIG, 64, quant="fp8", device="H100", context=128 * 1024, kv_dtype="fp8").memory["fits"]
    # a bigger device fits at fewer ranks: tp 32 at 1M tokens on B200, not on H100
    assert make_plan(BIG, 32, quant="fp8", device="B200", context=M, kv_dtype="fp8").memory["fits"]
    assert not make_plan(BIG, 32, quant="fp8", device="H100", context=M, kv_dtype="fp8").memory["fits"]
    # too long a context for memory: the largest one that fits is reported, below the request
    long = make_plan(BIG, 64, quant="fp8", device="H200", context=M, kv_dtype="bf16")
    assert not long.memory["fits"] and 0 < long.memory["max_context"] < M
    assert not any("max_position_embeddings" in w for w in long.warnings)  # 1M is within it
    # 64 heads over 64 ranks: q_b_proj slices are one head (192 rows), not a multiple of 128
    assert any("q_b_proj" in w and "192-wide" in w for w in long.warnings)
    # ... and at tp 32 the shared expert (2048 / 32 = 64) and the dense MLP (18432 / 32 = 576) are not either
    assert [r["tp"] for r in long.tp_table if r["fp8_misaligned"]] == [32, 64]


def test_presets_and_warnings():
    assert {"H200", "H100", "H20", "B200", "A100", "S5000", "S4000"} <= set(devices())
    assert find_device("mtt-s5000").backend == "musa" and find_device("h20").memory_gib > 90
    assert not find_device("A100").fp8 and not find_device("S4000").fp8
    p = make_plan(BIG, 64, quant="fp8", device="a100", context=2 * M, kv_dtype="fp8")
    joined = " ".join(p.warnings)
    assert "max_position_embeddings" in joined and "no native FP8" in joined
    with pytest.raises(UsageError, match="unknown --device 'TPU'.*H200"):
        find_device("TPU")


def test_parse_tokens():
    assert parse_tokens("1M") == M and parse_tokens("1m") == M and parse_tokens("128k") == 131072
    assert parse_tokens("4096") == 4096 and parse_tokens("1.5M") == 3 * M // 2
    for bad in ("", "1G", "lots", "0"):
        with pytest.raises(UsageError):
            parse_tokens(bad)


def test_real_checkpoint_uses_headers(checkpoint):
    ck = checkpoint("tiny-k25-dsv32")
    p = make_plan(str(ck), 4, quant="fp8", kv_dtype="fp8")
    assert p.source_kind == "checkpoint" and p.family == "kimi_k25"
    assert p.kv_cache["bytes_per_token"] == 3 * (128 + 4 + 2 * 64 + 2 * 64)  # 3 layers, kv_lora 128, index dim 64 (bf16)
    # the headers agree with what the config alone implies (bf16 weights, fp32 router bias)
    from_config = make_plan(str(ck / "config.json"), 4, quant="fp8", kv_dtype="fp8")
    assert from_config.rank == p.rank
    # and the same tp table and misaligned-fp8 warnings (that these do not depend on the order the files store the
    # tensors in is tests/source/test_tensor_groups.py::test_plan_groups_do_not_depend_on_the_order_tensors_are_stored_in)
    assert from_config.tp_table == p.tp_table and from_config.warnings == p.warnings
    assert any(r["fp8_misaligned"] for r in p.tp_table)
    assert [r["tp"] for r in p.tp_table if r["ok"]] == [1, 2, 4]
    with pytest.raises(UsageError, match=r"4 attention heads do not divide over 8 ranks.*work: 1, 2, 4$"):
        make_plan(str(ck), 8, quant="fp8")


def test_cli_json_and_errors(checkpoint, capsys):
    assert main(["plan", BIG, "--tp", "8", "--quant", "fp8", "--context", "1M", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["layout"]["tp"] == 8 and d["memory"]["context"] == M and d["rank"]["total"] > 300 * GIB
    assert main(["plan", BIG, "--tp", "8", "--quant", "fp8", "--device", "s5000"]) == 0
    out = capsys.readouterr().out
    assert "MTT S5000" in out and "does not fit" in out and "tp degrees" in out
    bad = [["plan", BIG, "--tp", "8", "--device", "TPUv9"],
           ["plan", str(checkpoint("tiny-k25-dsv32")), "--tp", "8"],
           ["plan", BIG, "--tp", "8", "--quant", "int3"],
           ["plan", BIG, "--tp", "8", "--context", "lots"]]
    for argv in bad:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("kconvert: error: ") and "\n" not in err, err
    assert main(["plan", str(checkpoint("tiny-k25-dsv32")), "--tp", "4", "--context", "8k"]) == 0
    assert "warning:" in capsys.readouterr().out  # 8K > the fixture's 4096 positions: a warning, not an error


def test_pp_1_plans_as_before_and_stages_share_the_weights():
    """--pp 1 (the default) is the tp-only plan; with --pp the stages' layers cover the model once and no
    stage's rank holds more than the tp-only rank (it holds a part of the same layers)."""
    p1 = make_plan(BIG, 16, quant="fp8")
    assert p1.pipeline is None
    p4 = make_plan(BIG, 16, quant="fp8", pp=4)
    assert sum(s["layer_count"] for s in p4.pipeline["stages"]) == p4.model["layers"]
    assert all(s["weights_bytes"] < p1.rank["total"] for s in p4.pipeline["stages"])
    assert p4.pipeline["world_size"] == 64 and p4.pipeline["nodes"] == 8
    assert p1.pp_search["best"] == make_plan(BIG, 8, quant="fp8").pp_search["best"]  # the search ignores --tp
