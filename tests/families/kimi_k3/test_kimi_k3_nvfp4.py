"""Kimi K3 and NVFP4 (issue 56): the MXFP4 release at `--quant nvfp4` (every expert block cast exactly, w1 / w3 sharing
weight_scale_2, lossless against mlx-lm on the release when the experts alone are converted; the rest by role, as
NVIDIA's recipe), NVIDIA's own NVFP4 K3 layout (ModelOpt's recipe: NVFP4 experts, block FP8 KDA / MLA) read, copied
and run, the exports in both layouts decoded by compressed-tensors' own decompressor, and bad NVFP4 input refused in
one line naming the tensor."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from helpers import cli_here, verify_json, cli_runs, stored_tensors

P = "language_model.model.layers."
PROMPTS = [{"id": "s", "kind": "short", "text": "Mixture-of-experts models route each token to a few experts."},
           {"id": "c", "kind": "chat", "chat": [{"role": "user", "content": "Why quantize weights to FP4?"}]}]


@pytest.fixture(scope="module")
def k3(tmp_path_factory, checkpoint):
    d = tmp_path_factory.mktemp("k3nvfp4")
    (d / "prompts.json").write_text(json.dumps(PROMPTS))
    src, nv = checkpoint("tiny-kimi-k3"), checkpoint("tiny-kimi-k3-nvfp4")
    runs = {"experts": ("shard", src, d / "experts", "--tp", 2, "--quant", "nvfp4", "--keep", "*self_attn*", "--json"),
            "copy": ("shard", nv, d / "copy", "--tp", 1, "--quant", "nvfp4"),
            "ref": ("reference", src, "--out", d / "ref.safetensors", "--prompts", d / "prompts.json"),
            "ref_nv": ("reference", nv, "--out", d / "ref_nv.safetensors", "--prompts", d / "prompts.json")}
    return {"d": d, "src": src, "nv": nv, **cli_runs(runs)}


def test_every_expert_block_casts_exactly_and_the_experts_alone_are_lossless(k3):
    """Shard counts every 16-block of every routed expert as cast exactly (none data-derived); verify against mlx-lm
    on the MXFP4 release: faithful and cost both under 1e-5, and the report carries the counts."""
    summary = json.loads(k3["experts"].stdout)
    casts = summary["exact_casts"]
    assert set(casts) == {"routed_experts.w1", "routed_experts.w2", "routed_experts.w3"}
    from kconvert.source.checkpoint import Checkpoint

    ck = Checkpoint.open(k3["src"])
    for w in ("w1", "w2", "w3"):  # every 16-block of every expert's weight, none data-derived
        blocks = sum(t.numel // 16 for n, t in ck.logical.items() if n.endswith(f".experts.{n.split('.experts.')[-1]}")
                     and n.endswith(f".{w}.weight"))
        assert casts[f"routed_experts.{w}"] == {"exact": blocks, "data_derived": 0} and blocks > 0
    r, rep = verify_json(k3["d"] / "experts", k3["d"] / "ref.safetensors")
    assert r.returncode == 0 and rep["verdict"] == "PASS", r.stderr
    assert rep["faithfulness"]["overall"]["mean_kld"] < 1e-5 and rep["cost"]["overall"]["mean_kld"] < 1e-5
    assert rep["exact_casts"] == casts


def test_w1_and_w3_share_weight_scale_2_and_keep_their_nibbles(k3):
    conv, src = stored_tensors(k3["d"] / "experts", P + "3.block_sparse_moe.experts.7."), \
        stored_tensors(k3["src"], P + "3.block_sparse_moe.experts.7.")
    base = P + "3.block_sparse_moe.experts.7."
    assert torch.equal(conv[base + "w1.weight_scale_2"], conv[base + "w3.weight_scale_2"])
    for w in ("w1", "w2", "w3"):
        assert torch.equal(conv[base + w + ".weight"], src[base + w + ".weight_packed"])  # verbatim codes
        assert conv[base + w + ".weight_scale"].dtype == torch.float8_e4m3fn
        assert conv[base + w + ".input_scale"].shape == ()


def test_the_rest_follows_nvidias_recipe_by_role(checkpoint):
    """KDA and MLA projections in 128x128 block FP8; convolutions, A_log, dt_bias, norms, the router, the latent
    projections, shared experts, the dense MLP and the head unquantized: decided by the manifest's roles."""
    from kconvert.convert.layout import Layout
    from kconvert.convert.shard.plan import plan_items
    from kconvert.quant.policy import QuantPolicy
    from kconvert.source.checkpoint import Checkpoint

    ck = Checkpoint.open(checkpoint("tiny-kimi-k3"))
    items = plan_items(ck, Layout.make(1, 1), QuantPolicy("nvfp4", family=ck.model.family))
    by = {}
    for w in items:
        for o in w.outputs:
            by.setdefault((o.info.component, o.transform), set()).add(o.src.removesuffix(".weight").rsplit(".", 1)[-1])
    assert by[("routed_experts", "mxfp4_to_nvfp4")] == {"w1", "w2", "w3"}
    assert {"q_proj", "k_proj", "v_proj", "g_proj", "o_proj", "f_a_proj", "f_b_proj"} <= by[("kda", "fp8")]
    assert {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"} <= by[("attention", "fp8")]
    kept = {c for c, t in by if t == "copy"}
    assert {"latent", "shared_experts", "dense_mlp", "router", "norm", "head", "embed"} <= kept
    assert "q_conv1d" in by[("kda", "copy")] and "A_log" in by[("kda", "copy")] and "dt_bias" in by[("kda", "copy")]


def test_nvidias_k3_layout_inspects_copies_and_runs(k3):
    """ModelOpt's recipe as stored: inspect names NVFP4 and block FP8; --quant nvfp4 copies the experts' bytes (scales
    and input_scale included) and the FP8 blocks; the engine on the copy gives the reference's log-probs."""
    r = cli_here("inspect", k3["nv"], "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["quantization"]["format"] == "nvfp4" and s["quantization"]["scheme"] == "nvfp4"
    assert {f["format"] for f in s["formats"]} >= {"nvfp4_packed", "block_fp8"}
    name = P + "2.block_sparse_moe.experts.5.w3."
    src, conv = stored_tensors(k3["nv"], name), stored_tensors(k3["d"] / "copy", name)
    assert sorted(src) == sorted(conv)
    for k in src:
        assert src[k].dtype == conv[k].dtype and src[k].shape == conv[k].shape, k
        assert torch.equal(src[k].reshape(-1).view(torch.uint8), conv[k].reshape(-1).view(torch.uint8)), k
    r, rep = verify_json(k3["d"] / "copy", k3["d"] / "ref_nv.safetensors")
    assert r.returncode == 0 and rep["cost"]["overall"]["mean_kld"] < 1e-5, r.stderr


def test_nvidia_layout_dequantizes_exactly(k3):
    """Reading an NVFP4 weight gives E2M1[code] * (e4m3 scale * weight_scale_2), and a ModelOpt FP8_PB_WO weight its
    e4m3 values times the [R/128, 1, C/128, 1] grid, by plain arithmetic here."""
    from kconvert.source.checkpoint import Checkpoint

    ck = Checkpoint.open(k3["nv"])
    name = P + "4.block_sparse_moe.experts.2.w2.weight"
    t = stored_tensors(k3["nv"], name[: -len("weight")])
    q = t[name].to(torch.int16)
    codes = torch.stack([q & 0xF, q >> 4], -1).view(q.shape[0], -1)
    mag = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])[(codes & 7).long()] * (1 - 2 * (codes >> 3))
    per = (t[name + "_scale"].float() * t[name + "_scale_2"]).repeat_interleave(16, 1)
    assert torch.equal(ck.read(name), mag * per)
    attn = P + "0.self_attn.q_proj.weight"
    a = stored_tensors(k3["nv"], attn)
    s = a[attn + "_scale"][:, 0, :, 0].repeat_interleave(128, 0).repeat_interleave(128, 1)
    assert torch.equal(ck.read(attn), a[attn].float() * s[: a[attn].shape[0], : a[attn].shape[1]])


@pytest.mark.parametrize("fmt", ["nvfp4", "nvfp4-ct"])
def test_exports_decode_in_compressed_tensors_to_the_releases_values(k3, fmt):
    """Both export layouts of the MXFP4 release: compressed-tensors' NVFP4 decompressor (its own code; ModelOpt's
    layout through compressed-tensors' converter's 1 / weight_scale_2) gives the release's MXFP4 values bit for bit
    (every block cast exactly), and the configs say what vLLM / SGLang read."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import NVFP4

    from kconvert.source.checkpoint import Checkpoint

    out = k3["d"] / f"export-{fmt}"
    if not out.exists():
        r = cli_here("export", k3["src"], out, "--format", fmt)
        assert r.returncode == 0, r.stderr
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    src = Checkpoint.open(k3["src"])
    name = P + "5.block_sparse_moe.experts.11.w1."
    t = stored_tensors(out, name)
    if fmt == "nvfp4-ct":
        assert qc["format"] == "nvfp4-pack-quantized"
        QuantizationConfig.model_validate(qc)  # compressed-tensors parses what it will read
        sd = {"weight_packed": t[name + "weight_packed"], "weight_scale": t[name + "weight_scale"],
              "weight_global_scale": t[name + "weight_global_scale"]}
    else:
        hf = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
        assert qc["quant_method"] == "modelopt_mixed" and qc["quant_algo"] == hf["quant_algo"] == "MIXED_PRECISION"
        layers = qc["quantized_layers"]
        assert layers[P + "5.block_sparse_moe.experts"]["quant_algo"] == "NVFP4"
        assert layers["layers.5.block_sparse_moe.experts"] == layers[P + "5.block_sparse_moe.experts"]  # vLLM's names
        assert layers[P + "0.self_attn.q_proj"] == {"quant_algo": "FP8_PB_WO"}
        attn = stored_tensors(out, P + "0.self_attn.q_proj.weight_scale")
        assert next(iter(attn.values())).dim() == 4
        sd = {"weight_packed": t[name + "weight"], "weight_scale": t[name + "weight_scale"],
              "weight_global_scale": (1.0 / t[name + "weight_scale_2"]).reshape(1)}
    got = NVFP4PackedCompressor.decompress(sd, QuantizationScheme(targets=["Linear"], **NVFP4))["weight"]
    assert torch.equal(got, src.read(name + "weight").to(torch.bfloat16))


def _damaged(src, tmp_path, mutate) -> object:
    """A copy of `src` whose tensors (of every file) `mutate(tensors)` may change."""
    from safetensors.torch import load_file, save_file

    d = tmp_path / "bad"
    shutil.copytree(src, d)
    for f in sorted(d.glob("*.safetensors")):
        tensors = load_file(f)
        if mutate(tensors):
            save_file(tensors, f, metadata={"format": "pt"})
    return d


E = P + "1.block_sparse_moe.experts.4."


def _set(name, fn):
    def mutate(t):
        if name not in t:
            return False
        t[name] = fn(t[name])
        return True
    return mutate


@pytest.mark.parametrize("name,fn,quant,message", [
    (E + "w2.weight_scale", lambda s: s.view(torch.uint8).index_fill(1, torch.tensor([2]), 0x7F).view(s.dtype), "none",
     "NaN"),
    (E + "w2.weight_scale_2", lambda s: torch.zeros_like(s), "none", "finite and positive"),
    (E + "w2.weight_scale_2", lambda s: torch.full_like(s, float("inf")), "none", "finite and positive"),
    (E + "w2.weight_scale_2", lambda s: -s, "nvfp4", "finite and positive"),
    (E + "w2.weight_scale", lambda s: s[:, :-1].contiguous(), "none", "F8_E4M3 scale"),
    (E + "w3.weight_scale_2", lambda s: s * 2, "nvfp4", "fused partner"),
])
def test_bad_nvfp4_input_is_one_line_naming_the_tensor(k3, tmp_path, name, fn, quant, message):
    bad = _damaged(k3["nv"], tmp_path, _set(name, fn))
    r = cli_here("shard", bad, tmp_path / "out", "--tp", 1, "--quant", quant)
    assert r.returncode == 2 and message in r.stderr and name.rsplit(".", 1)[0] in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert not (tmp_path / "out" / "kconvert.json").exists()
