"""Exports written in a spelling vLLM misreads, made on purpose (conftest.misread_copies), are caught by the check
that vLLM itself loads them: each fails, and says where."""

from __future__ import annotations

from helpers import cli_here


def test_e8m0_scales_beside_expert_dtype_fp8_load_wrong_and_fail(loads):
    """The V4 fp8-block export of a BF16 source as kconvert wrote it until 2026-12 (e8m0 `.scale` tensors, `expert_dtype:
    fp8`): vLLM keeps each routed expert's e8m0 byte as a number (2^-12 as 115.0), silently; the check fails there and
    only there."""
    check = loads["e8m0-beside-fp8"]
    assert not check.refused and not check.passed
    wrong = {r.kind: r.max_error for r in check.rows if r.max_error}
    assert list(wrong) == ["routed_experts"] and wrong["routed_experts"] > 1e3, wrong


def test_v3_config_without_routing_keys_is_refused_by_vllm(loads):
    """transformers' save_pretrained drops `topk_method: noaux_tc`: vLLM's DeepSeek-V3 then has no place for the router's
    correction bias."""
    check = loads["v3-without-routing-keys"]
    assert not check.passed and "e_score_correction_bias" in check.refused, check.refused


def test_v4_config_in_transformers_spelling_is_refused_by_vllm(loads):
    """`mlp_layer_types: hash_moe` (transformers' V4 spelling): vLLM's V4 config refuses it."""
    check = loads["v4-transformers-spelling"]
    assert not check.passed and "mlp_layer_types" in check.refused, check.refused


def test_fp8_block_without_its_unquantized_vision_named_loads_wrong(loads):
    """Kimi-K2.5's fp8-block export keeps the vision tower bf16; without `modules_to_not_convert` naming it, vLLM builds
    it in FP8: its weights load into FP8 parameters (rounded) and their scales are missing, with no error."""
    check = loads["k25-fp8-vision-unnamed"]
    assert not check.refused and not check.passed
    assert check.missing and all(n.startswith(("vision_tower.", "mm_projector.")) for n in check.missing), check.missing
    assert {r.kind for r in check.rows if r.max_error} <= {"vision", "projector"}, [(r.kind, r.max_error) for r in check.rows]
    assert any(r.max_error for r in check.rows if r.kind == "vision")


def test_serve_check_prints_the_table_and_fails_on_the_misread(loads):
    """The CLI on the misread export: the table names the kind, exit 1 (vLLM runs again here: one load)."""
    r = cli_here("serve-check", loads["e8m0-beside-fp8"].export)
    assert r.returncode == 1, r.stderr
    assert "routed_experts" in r.stdout and "FAIL" in r.stdout and "largest difference, routed_experts" in r.stdout
