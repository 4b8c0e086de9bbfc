"""Kimi K3 as released, against the independent reference (mlx-lm's kimi_k3 on MLX's CPU backend; mlx-vlm's vision
tower and projector for image prompts), on a K3 config that is not the tiny preset (another KDA / MLA schedule,
attention-residual block size, latent width, expert count, vision tower): the fixture is what mlx-lm loads strictly;
conversions at tp 1, tp 2 and tp 2 x pp 2 (a stage boundary inside an attention-residual block) give the
references' log-probs on text and image prompts; MXFP4 experts are copied bit for bit
(--quant fp4) or re-encoded exactly (fp8); a damaged conversion FAILs verify with its layer named; bad MXFP4 /
K3 input is one line naming the file and tensor."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from helpers import cli_here, verify_json
from kconvert.fixtures.models.kimi_k3 import k3_config, write_kimi_checkpoint
from kconvert.verify import damage

# not the preset: 6 layers, MLA on (1-based) 2 and 6, blocks of 2, a latent of 160, 8 experts (top 3), 2 KDA heads
OTHER = {"num_hidden_layers": 6, "hidden_size": 192, "intermediate_size": 384, "num_attention_heads": 2,
         "num_key_value_heads": 2, "q_lora_rank": 96, "kv_lora_rank": 64, "qk_nope_head_dim": 32,
         "qk_rope_head_dim": 16, "v_head_dim": 48, "attn_res_block_size": 2, "routed_expert_hidden_size": 160,
         "num_experts": 8, "num_experts_per_token": 3, "num_shared_experts": 1, "moe_intermediate_size": 96,
         "linear_attn_config": {"num_heads": 2, "head_dim": 96, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
                                "use_full_rank_gate": True, "kda_layers": [1, 3, 4, 5], "full_attn_layers": [2, 6]}}
OTHER_VISION = {"vt_num_hidden_layers": 3, "vt_hidden_size": 96, "qkv_hidden_size": 64, "vt_num_attention_heads": 4,
                "vt_intermediate_size": 160, "init_pos_emb_height": 12, "init_pos_emb_width": 12, "mm_hidden_size": 96}
P = "language_model.model.layers."


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    """The non-preset K3 (MXFP4 experts) with its conversions and its MLX reference."""
    d = tmp_path_factory.mktemp("k3")
    src = d / "src"
    src.mkdir()
    write_kimi_checkpoint(src, k3_config(OTHER, vision_overrides=OTHER_VISION), seed=3, storage="mxfp4")
    for args in (("shard", src, d / "tp1", "--tp", 1, "--quant", "fp4"),
                 ("shard", src, d / "tp2", "--tp", 2),
                 ("shard", src, d / "tp2pp2", "--tp", 2, "--pp", 2, "--pp-layers", "0-2,3-5"),
                 ("reference", src, "--out", d / "ref.safetensors", "--hidden-states")):
        r = cli_here(*args)
        assert r.returncode == 0, r.stderr
    return d


verify = verify_json


def test_the_fixture_is_what_mlx_lm_loads_and_its_loop_is_mlx_lms_forward(k3):
    """mlx-lm loads the released layout strictly (a name it does not know, or lacks, fails), and the reference's
    own loop over mlx-lm's layers (which reads the states between them) gives the model's own logits."""
    import mlx.core as mx
    import numpy as np

    from kconvert.verify.mlx_reference import MlxReference

    ref = MlxReference(k3 / "src", torch.float32)
    ids = torch.tensor([[1, 5, 9, 17, 33, 65, 129, 200, 7, 3, 11]])
    ours = ref(ids, output_hidden_states=True)
    own = np.array(ref.model(mx.array(ids.numpy())).astype(mx.float32))
    assert np.abs(ours.logits.numpy() - own).max() < 1e-5
    assert len(ours.hidden_states) == OTHER["num_hidden_layers"] + 1


def test_inspect_names_every_k3_component(k3):
    r = cli_here("inspect", k3 / "src", "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["family"] == "kimi_k3" and s["quantization"]["scheme"] == "fp4"
    assert {"kda", "attention", "attn_res", "latent", "routed_experts", "shared_experts", "dense_mlp"} <= set(s["params"])
    assert s["model"]["layer_kinds"]["attn_kind"] == {"kda": 4, "mla": 2}
    assert s["model"]["routed_experts"] == 8 and s["model"]["experts_per_token"] == 3
    assert {f["format"] for f in s["formats"]} == {"plain", "fp4_packed"}


@pytest.mark.parametrize("layout", ["tp1", "tp2", "tp2pp2"])
def test_conversions_give_mlx_lms_log_probs(k3, layout):
    r, rep = verify(k3 / layout, k3 / "ref.safetensors", "--per-layer")
    assert r.returncode == 0 and rep["verdict"] == "PASS", r.stderr
    assert rep["cost"]["overall"]["mean_kld"] < 1e-5, rep["cost"]["overall"]  # vs mlx-lm on the release itself
    assert rep["cost"]["by_kind"]["image"]["positions"] > 0 and rep["cost"]["by_kind"]["image"]["mean_kld"] < 1e-5
    assert rep["vision_error"] < 1e-5  # the engine's tower + projector vs mlx-vlm's on the same patches
    assert rep["fault_at"] is None


def test_fp4_copies_the_released_mxfp4_bytes(k3):
    from safetensors import safe_open

    name = P + "2.block_sparse_moe.experts.5.w1.weight"

    def stored(folder):
        out = {}
        for f in sorted(folder.rglob("*.safetensors")):
            with safe_open(str(f), "pt") as h:
                out.update({k: h.get_tensor(k) for k in h.keys() if k.startswith(name)})
        return out

    src, conv = stored(k3 / "src"), stored(k3 / "tp1")
    assert sorted(src) == sorted(conv) == [name + "_packed", name + "_scale"]
    for k in src:
        assert torch.equal(src[k].view(torch.uint8), conv[k].view(torch.uint8)), k


def test_fp8_reencodes_the_mxfp4_experts_exactly(k3, tmp_path):
    """GPUs without FP4 (H200, H20, S5000): the experts become block FP8 with nothing lost (the rest kept)."""
    out = tmp_path / "fp8"
    r = cli_here("shard", k3 / "src", out, "--tp", 2, "--quant", "fp8", "--keep", "*", "--quantize", "*.experts.*")
    assert r.returncode == 0, r.stderr
    r, rep = verify(out, k3 / "ref.safetensors")
    assert r.returncode == 0 and rep["cost"]["overall"]["mean_kld"] < 1e-5, rep["cost"]["overall"]


@pytest.mark.parametrize("what,name", [
    ("one KDA head's A_log", P + "2.self_attn.A_log"),
    ("one expert's MXFP4 scales", P + "3.block_sparse_moe.experts.1.w2.weight_scale"),
    ("one attention-residual projection", P + "4.mlp_res_proj.weight"),
])
def test_damage_fails_verify_with_the_layer_named(k3, tmp_path, what, name):
    out = tmp_path / "damaged"
    shutil.copytree(k3 / "tp1", out)
    layer = int(name[len(P):].split(".")[0])

    def hurt(t):
        if name.endswith("A_log"):
            t[name][1] += 2.0  # head 1's decay rate x e^2
        elif name.endswith("weight_scale"):
            t[name][3] = (t[name][3].view(torch.uint8) + 2).view(t[name].dtype)  # one row's scales x4
        else:
            t[name].mul_(-1.0)

    damage.rewrite(out, damage.files_holding(out, name)[0], hurt)
    r, rep = verify(out, k3 / "ref.safetensors", "--per-layer")
    assert r.returncode == 1 and rep["faithfulness"]["verdict"] == "FAIL", (what, r.stderr)
    assert rep["fault_at"] == f"layer {layer}", (what, rep["fault_at"])


def test_tp_that_does_not_divide_the_heads_is_refused_naming_those_that_do(k3, tmp_path):
    r = cli_here("shard", k3 / "src", tmp_path / "x", "--tp", 4)
    assert r.returncode == 2 and "tp degrees that work: 1, 2" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "x" / "kconvert.json").exists()


def _with(src, tmp_path, name: str, mutate) -> object:
    """A copy of the source whose tensor `name` is changed by `mutate(tensor)` (same shape and dtype)."""
    from safetensors.torch import load_file, save_file

    d = tmp_path / "bad"
    shutil.copytree(src, d)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    f = d / index["weight_map"][name]
    tensors = load_file(f)
    mutate(tensors[name])
    save_file(tensors, f, metadata={"format": "pt"})
    return d


@pytest.mark.parametrize("name,mutate,message", [
    (P + "1.block_sparse_moe.experts.2.w3.weight_scale", lambda t: t[0].fill_(255), "NaN"),
    (P + "0.self_attn.A_log", lambda t: t.__setitem__(1, float("nan")), "NaN"),
])
def test_bad_values_are_one_line_naming_file_and_tensor(k3, tmp_path, name, mutate, message):
    bad = _with(k3 / "src", tmp_path, name, mutate)
    r = cli_here("shard", bad, tmp_path / "out", "--tp", 1)
    assert r.returncode == 2 and message in r.stderr and name in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "out" / "kconvert.json").exists()


def test_an_mxfp4_scale_that_disagrees_with_its_codes_is_refused(k3, tmp_path):
    """weight_scale [rows, C/32] must match weight_packed [rows, C/2]: a truncated scale grid names the tensor."""
    from safetensors.torch import load_file, save_file

    d = tmp_path / "bad"
    shutil.copytree(k3 / "src", d)
    name = P + "1.block_sparse_moe.experts.0.w1.weight_scale"
    index = json.loads((d / "model.safetensors.index.json").read_text())
    f = d / index["weight_map"][name]
    tensors = load_file(f)
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, f, metadata={"format": "pt"})
    r = cli_here("inspect", d)
    assert r.returncode == 2 and name in r.stderr and "MXFP4" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_the_trained_fixture_is_written_back_under_the_released_names(tmp_path):
    """tiny-kimi-k3-trained trains through mlx-lm's model; its parameters go back to the released layout by the
    inverse of mlx-lm's sanitize: reloading them gives every trained parameter back (as bf16 where stored so)."""
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    from kconvert.fixtures.models.kimi_k3 import released_tensors
    from kconvert.fixtures.storage.shards import write_tensors
    from kconvert.fixtures.training.kimi_k3 import released_from_mlx, train_k3

    start = tmp_path / "start"
    start.mkdir()
    write_kimi_checkpoint(start, k3_config(OTHER, storage="bf16"), 1, "bf16")
    params, losses = train_k3(start, 1, steps=1, batch=2, seq_len=16)
    like = released_tensors(k3_config(OTHER, storage="bf16"), 1, "bf16")
    back = released_from_mlx(params, k3_config(OTHER), like)
    assert set(back) == {n for n in like if n.startswith("language_model.")} and len(losses) == 1
    like = {n: t for n, t in like.items() if n in back}  # the text model (mlx-lm's kimi_k3 has no vision tower)
    out = tmp_path / "back"
    out.mkdir()
    tensors = {n: back[n].to(like[n].dtype) for n in like}
    write_tensors(out, tensors, list(tensors), 2)
    config = k3_config(OTHER, storage="bf16")
    config.pop("vision_config")
    (out / "config.json").write_text(json.dumps(config))
    model, _ = load_model(out, strict=True)
    model.set_dtype(mx.float32)
    reloaded = dict(tree_flatten(model.parameters()))
    for name, value in params.items():
        a = torch.from_numpy(np.array(value.astype(mx.float32)))
        kept_f32 = name.endswith(("A_log", "dt_bias", "e_score_correction_bias", "conv.weight", "o_norm.weight"))
        want = a if kept_f32 else a.to(torch.bfloat16).float()
        assert torch.equal(want, torch.from_numpy(np.array(reloaded[name].astype(mx.float32)))), name


def test_gptq_calibrates_through_k3s_layers(k3, tmp_path):
    """--calibrate runs the layers one at a time through the engine (KDA states, attention-residual blocks that grow
    the residual, the latent experts fed their down-projected tokens): every layer calibrated, and the result
    faithful to its own codes."""
    out = tmp_path / "gptq"
    r = cli_here("shard", k3 / "src", out, "--tp", 2, "--quant", "int4", "--calibrate", "stdlib",
                 "--calibration-tokens", 256, "--calibration-seq", 32, "--json")
    assert r.returncode == 0, r.stderr
    layers = json.loads(r.stdout)["calibration"]["layers"]
    assert [f["layer"] for f in layers] == list(range(OTHER["num_hidden_layers"]))
    assert all(f.get("experts", 8) == 8 for f in layers[1:]) and all(f["output_rel_error"] < 0.5 for f in layers)
    r, rep = verify(out, k3 / "ref.safetensors")
    assert rep["faithfulness"]["verdict"] == "PASS", r.stderr


def test_fp8_block_export_for_gpus_without_fp4_reads_back(k3, tmp_path):
    """`export --format fp8-block`: a Hugging Face layout for FP8 kernels (H200, H20, S5000), its MXFP4 experts
    re-encoded exactly; inspect names its format, and verify of the export is faithful (at tp 1: the tiny widths'
    row slices would cut its 128 x 128 blocks at tp 2, which shard refuses without --requantize)."""
    out = tmp_path / "fp8b"
    r = cli_here("export", k3 / "src", out, "--format", "fp8-block", "--json")
    assert r.returncode == 0, r.stderr
    r = cli_here("inspect", out, "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["quantization"]["format"] == "fp8-block", r.stderr
    r, rep = verify(out, k3 / "ref.safetensors", "--tp", 1)
    assert rep is not None and rep["faithfulness"]["verdict"] == "PASS", r.stderr


def test_a_packed_expert_that_disagrees_with_the_config_names_it(k3, tmp_path):
    """weight_packed holding fewer columns than moe_intermediate_size implies: the logical shape is refused."""
    from safetensors.torch import load_file, save_file

    d = tmp_path / "bad"
    shutil.copytree(k3 / "src", d)
    stem = P + "2.block_sparse_moe.experts.4.w2.weight"
    index = json.loads((d / "model.safetensors.index.json").read_text())
    f = d / index["weight_map"][stem + "_packed"]
    tensors = load_file(f)
    tensors[stem + "_packed"] = tensors[stem + "_packed"][:, :-16].contiguous()  # 32 columns fewer
    tensors[stem + "_scale"] = tensors[stem + "_scale"][:, :-1].contiguous()  # a consistent scale grid
    save_file(tensors, f, metadata={"format": "pt"})
    r = cli_here("inspect", d)
    assert r.returncode == 2 and stem in r.stderr and "Traceback" not in r.stderr, r.stderr
