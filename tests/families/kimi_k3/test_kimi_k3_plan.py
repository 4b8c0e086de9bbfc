"""`kconvert plan` of Kimi K3: the bundled `kimi-k3` config (the released values) and a tiny K3 checkpoint. The cache
is what it is: a fixed KDA state per sequence on the KDA layers (split by heads over tp) plus one MLA latent row per
token on the MLA layers only, and exactly what the engine allocates; `--quant auto` keeps MXFP4 where a device
runs FP4 and re-encodes it as FP8 where it does not."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import cli_here
from kconvert.plan.memory import make_plan

M = 1 << 20
KDA_LAYER_STATE = 96 * 128 * 128 * 4 + 3 * 3 * 96 * 128 * 2  # float32 [96, 128, 128] + bf16 conv windows (K-1 = 3)


def test_the_released_config_at_1m_tokens():
    p = make_plan("kimi-k3", 8, quant="fp8", device="H200", context=M)
    kv = p.kv_cache
    assert kv["cache"] == "hybrid" and kv["mla_layers"] == 24 and kv["kda_layers"] == 69
    assert kv["mla_bytes_per_token"] == 24 * 2 * (512 + 64)  # 27,648 B: bf16 latent + key part, MLA layers only
    assert kv["kda_bytes_per_sequence"] == 69 * KDA_LAYER_STATE // 8  # this rank's 12 of 96 heads
    assert p.memory["kv_bytes"] == 24 * 1152 * M + 69 * KDA_LAYER_STATE // 8
    # the cache grows with the MLA layers only: 8x the context, 8x their bytes, the same KDA bytes
    short = make_plan("kimi-k3", 8, quant="fp8", device="H200", context=M // 8)
    assert p.memory["kv_bytes"] - short.memory["kv_bytes"] == 24 * 1152 * (M - M // 8)
    assert p.total_params > 2.7e12 and {"kda", "attn_res", "latent", "routed_experts"} <= set(p.params)


def test_tp_degrees_must_divide_the_96_heads():
    p = make_plan("kimi-k3", 8, quant="fp8")
    ok = {r["tp"]: r["ok"] for r in p.tp_table}
    assert ok[8] and ok[32] and not ok[64]
    r = cli_here("plan", "kimi-k3", "--tp", "64", "--quant", "fp8")
    assert r.returncode == 2 and "96 attention heads do not divide over 64 ranks" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("device,want", [("B200", "nvfp4"), ("B300", "nvfp4"), ("H200", "fp8"), ("H20", "fp8"),
                                         ("S5000", "fp8")])
def test_quant_auto_picks_nvfp4_on_blackwell_and_fp8_on_hopper(device, want):
    """Blackwell runs NVFP4 (NVIDIA's K3 recipe: the MXFP4 experts cast exactly); Hopper and MUSA have no FP4."""
    p = make_plan("kimi-k3", 8, quant="auto", device=device)
    assert p.quant == want, p.quant_reason


def test_plan_counts_nvfp4_bytes_by_role():
    """nvfp4 on K3: routed experts at half a byte plus one e4m3 scale per 16 values (and a float32 pair each), the
    KDA and MLA projections in 128x128 block FP8 (NVIDIA's recipe), the latent and shared experts bf16."""
    nv_ranks, fp4_ranks = (make_plan("kimi-k3", 8, quant=q, device="B200").to_json()["rank"]["bytes"]
                           for q in ("nvfp4", "fp4"))
    experts = 92 * 896 // 8 * (2 * 3072 * 3584 + 3584 * 3072)  # values of one rank's routed experts
    assert nv_ranks["routed_experts"] == experts // 2 + experts // 16 + 112 * 92 * 3 * 8
    assert fp4_ranks["routed_experts"] == experts // 2 + experts // 32
    assert nv_ranks["kda"] < 0.51 * fp4_ranks["kda"]  # FP8 (and its scales) where fp4 keeps bf16
    assert nv_ranks["latent"] == fp4_ranks["latent"] and nv_ranks["shared_experts"] == fp4_ranks["shared_experts"]


def test_plan_cli_json_names_the_hybrid_cache():
    r = cli_here("plan", "kimi-k3", "--tp", "8", "--quant", "auto", "--device", "H200", "--context", "1M", "--json")
    assert r.returncode == 0, r.stderr
    kv = json.loads(r.stdout)["kv_cache"]
    assert (kv["mla_layers"], kv["kda_layers"]) == (24, 69)


def test_the_engine_allocates_what_plan_says(conversion, checkpoint):
    """On tiny-kimi-k3, after prompts of several lengths: the KDA states the engine holds are plan's bytes per
    sequence, and its MLA rows plan's bytes per token times the tokens (pages aside)."""
    from engine.model import Model

    kv = make_plan(str(checkpoint("tiny-kimi-k3")), 1, kv_dtype="bf16").kv_cache
    model = Model.from_converted(conversion("tiny-kimi-k3", tp=1), dtype=torch.bfloat16)
    for n in (5, 37, 130):
        cache = model.new_cache(1, 256)
        model.forward(torch.arange(n)[None] % 700 + 3, cache)
        assert sum(s.nbytes() for s in cache.states) == kv["kda_bytes_per_sequence"], n
        assert sum(layer.cache.lat_fmt.row_bytes for layer in cache.latent_layers) * n == kv["mla_bytes_per_token"] * n
        assert cache.lengths == [n]
