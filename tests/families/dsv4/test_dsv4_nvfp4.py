"""DeepSeek-V4 and NVFP4 (issue 56): V4-Flash's FP4 experts at `--quant nvfp4` (cast exactly, lossless against the
release; the rest as released FP8, the drafter's experts MXFP4, as NVIDIA's V4 NVFP4 builds), NVIDIA's V4-Flash-0731-
NVFP4 layout read and run, and the export in V4's own layout (what vLLM's DeepseekV4FP8Config routes by
`moe_quant_algo`) and in compressed-tensors' decoded by compressed-tensors to the release's values."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import cli_here, verify_json, cli_runs, stored_tensors

PROMPTS = [{"id": "s", "kind": "short", "text": "Mixture-of-experts models route each token to a few experts."},
           {"id": "l", "kind": "long", "text": "def route(tokens, experts): return topk(scores, k). " * 40}]


@pytest.fixture(scope="module")
def v4(tmp_path_factory, checkpoint):
    d = tmp_path_factory.mktemp("v4nvfp4")
    (d / "prompts.json").write_text(json.dumps(PROMPTS))
    src, nv = checkpoint("tiny-dsv4-flash"), checkpoint("tiny-dsv4-dspark-nvfp4")
    runs = {"cast": ("shard", src, d / "cast", "--tp", 1, "--quant", "nvfp4", "--no-draft-heads", "--json"),
            "copy": ("shard", nv, d / "copy", "--tp", 1, "--quant", "nvfp4", "--no-draft-heads"),
            "ref": ("reference", src, "--out", d / "ref.safetensors", "--prompts", d / "prompts.json"),
            "ref_nv": ("reference", nv, "--out", d / "ref_nv.safetensors", "--prompts", d / "prompts.json")}
    return {"d": d, "src": src, "nv": nv, **cli_runs(runs)}


def test_fp4_experts_cast_exactly_and_the_conversion_is_lossless(v4):
    casts = json.loads(v4["cast"].stdout)["exact_casts"]
    assert set(casts) == {"routed_experts.w1", "routed_experts.w2", "routed_experts.w3"}
    assert all(c["exact"] > 0 and c["data_derived"] == 0 for c in casts.values())
    r, rep = verify_json(v4["d"] / "cast", v4["d"] / "ref.safetensors")
    assert r.returncode == 0 and rep["verdict"] == "PASS", r.stderr
    assert rep["faithfulness"]["overall"]["mean_kld"] < 1e-5 and rep["cost"]["overall"]["mean_kld"] < 1e-5


def test_the_rest_as_released_and_the_drafter_experts_mxfp4(checkpoint):
    """NVIDIA's V4 builds: the FP8 linears copied, the MTP block's routed experts kept MXFP4 (their `ignore`)."""
    from kconvert.convert.layout import Layout
    from kconvert.convert.shard.plan import plan_items
    from kconvert.quant.policy import QuantPolicy
    from kconvert.source.checkpoint import Checkpoint

    ck = Checkpoint.open(checkpoint("tiny-dsv4-flash"))
    items = plan_items(ck, Layout.make(1, 1), QuantPolicy("nvfp4", family=ck.model.family))
    by = {}
    for w in items:
        for o in w.outputs:
            by.setdefault(o.transform, set()).add("mtp" if o.src.startswith("mtp.") else o.info.component)
    assert by["mxfp4_to_nvfp4"] == {"routed_experts"} and by["fp4_copy"] == {"mtp"}
    assert {"attention", "shared_experts", "indexer", "mtp"} <= by["fp8_copy"]
    assert "nvfp4" not in by and "fp8" not in by  # nothing rounded


def test_nvidias_v4_nvfp4_build_reads_copies_and_runs(v4):
    r = cli_here("inspect", v4["nv"], "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["quantization"]["format"] == "nvfp4"
    assert {f["format"] for f in s["formats"]} >= {"nvfp4_packed", "fp4_packed", "block_fp8"}
    name = "layers.2.ffn.experts.3.w1."
    src, conv = stored_tensors(v4["nv"], name), stored_tensors(v4["d"] / "copy", name)
    assert sorted(src) == sorted(conv) == [name + s for s in ("input_scale", "weight", "weight_scale", "weight_scale_2")]
    for k in src:
        assert torch.equal(src[k].reshape(-1).view(torch.uint8), conv[k].reshape(-1).view(torch.uint8)), k
    r, rep = verify_json(v4["d"] / "copy", v4["d"] / "ref_nv.safetensors")
    assert r.returncode == 0 and rep["cost"]["overall"]["mean_kld"] < 1e-5, r.stderr
    from kconvert.plan.memory import make_plan

    p = make_plan(str(v4["nv"]), 1, quant="auto", device="B200")
    assert p.quant == "nvfp4" and "own format" in p.quant_reason


def test_export_in_v4s_layout_is_nvidias_v4_nvfp4_layout(v4):
    """`export --format nvfp4` of V4-Flash writes what NVIDIA's V4-Flash-0731-NVFP4 stores: the same tensors in the
    same dtypes role by role, quant_method fp8 with moe_quant_algo NVFP4, expert_dtype fp4, the drafter ignored."""
    out = v4["d"] / "export"
    r = cli_here("export", v4["src"], out, "--format", "nvfp4")
    assert r.returncode == 0, r.stderr
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert (qc["quant_method"], qc["moe_quant_algo"], qc["quant_algo"], cfg["expert_dtype"]) == \
        ("fp8", "NVFP4", "MIXED_PRECISION", "fp4")
    assert qc["ignore"] == ["mtp.0.*"] and qc["scale_fmt"] == "ue8m0"
    assert qc["quantized_layers"]["layers.1.ffn.experts"] == {"quant_algo": "NVFP4", "group_size": 16}
    for prefix in ("layers.1.ffn.experts.4.w2.", "layers.1.attn.wq_b.", "layers.1.ffn.shared_experts.w1."):
        ours, nvidia = stored_tensors(out, prefix), stored_tensors(v4["nv"], prefix)
        assert {k: (t.dtype, t.shape) for k, t in ours.items()} == {k: (t.dtype, t.shape) for k, t in nvidia.items()}
    mtp = stored_tensors(out, "mtp.0.ffn.experts.0.w1.")
    assert {k: t.dtype for k, t in mtp.items()} == {"mtp.0.ffn.experts.0.w1.weight": torch.int8,
                                                    "mtp.0.ffn.experts.0.w1.scale": torch.float8_e8m0fnu}
    r = cli_here("inspect", out, "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["quantization"]["format"] == "nvfp4", r.stderr


def test_compressed_tensors_export_decodes_to_the_releases_values(v4):
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import NVFP4

    from kconvert.source.checkpoint import Checkpoint

    out = v4["d"] / "export-ct"
    r = cli_here("export", v4["src"], out, "--format", "nvfp4-ct")
    assert r.returncode == 0, r.stderr
    src = Checkpoint.open(v4["src"])
    for name in ("layers.0.ffn.experts.1.w3.weight", "mtp.0.ffn.experts.2.w2.weight"):
        t = stored_tensors(out, name)
        sd = {"weight_packed": t[name + "_packed"], "weight_scale": t[name + "_scale"],
              "weight_global_scale": t[name + "_global_scale"]}
        got = NVFP4PackedCompressor.decompress(sd, QuantizationScheme(targets=["Linear"], **NVFP4))["weight"]
        assert torch.equal(got, src.read(name).to(torch.bfloat16)), name
