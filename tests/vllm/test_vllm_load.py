"""Every export format of each family vLLM's CPU path builds (DeepSeek-V3, Kimi-K2.5, DeepSeek-V4), loaded by vLLM's
own model class and loader: every stored weight, as vLLM holds it (dequantized from its parameters, in the dtypes it
chose for them), equals kconvert's dequantization of the same tensor, and nothing is missing or left over (V4's MTP
block apart: vLLM's MTP model loads it, not the target). The checks that a damaged or misspelled export fails are in
test_vllm_misreads.py."""

from __future__ import annotations

import pytest

from conftest import LOADED, V4_COMPRESSED


@pytest.mark.parametrize("preset,fmt", LOADED, ids=[f"{p}-{f}" for p, f in LOADED])
def test_vllm_loads_every_weight_as_kconvert_reads_it(loads, preset, fmt):
    check = loads[preset, fmt]
    assert not check.refused, check.refused
    assert check.missing == {} and check.unexpected == [], (check.missing, check.unexpected)
    assert check.errors == {}, sorted(check.errors.items(), key=lambda kv: -kv[1])[:5]
    found = {r.kind: r.found for r in check.rows}
    assert found.get("routed_experts", 0) > 0 and found.get("attention", 0) > 0, found
    if preset == "tiny-k25-dsv3":  # the vision tower and projector load too (unquantized: modules_to_not_convert)
        assert check.model_class == "KimiK25ForConditionalGeneration" and found.get("vision", 0) > 0, found
    if preset.startswith("tiny-dsv4"):  # the MTP block is the draft model's, counted apart
        assert [r.draft for r in check.rows if r.kind == "mtp"] == [53]
    assert check.passed


@pytest.mark.parametrize("preset,fmt", V4_COMPRESSED, ids=[f"{p}-{f}" for p, f in V4_COMPRESSED])
def test_vllm_does_not_read_v4_in_compressed_tensors(loads, preset, fmt):
    """vLLM 0.32's DeepSeek-V4 loads only DeepSeek's own FP8 layout: its weights mapper renames every non-expert
    `.weight_scale` to `.weight_scale_inv` (AMD Quark's spelling) and its MoE takes one scheme for all projections.
    kconvert's V4 exports in these formats are for kconvert and compressed-tensors readers (docs/EXPORT.md); this
    test says when vLLM starts reading them."""
    check = loads[preset, fmt]
    assert check.refused, "vLLM now loads V4 compressed-tensors exports: check them like the others (docs/EXPORT.md)"
    assert "weight_scale_inv" in check.refused or "same quantization scheme" in check.refused, check.refused
