"""tiny-dsv4 / tiny-dsv4-flash: transformers' DeepseekV4ForCausalLM written under the released names.
Every transformers tensor is written exactly once and reads back equal (through kconvert's reader and
through transformers' own loader, i.e. its conversion_mapping); the flash preset is the same weights in
V4-Flash's FP8 + FP4 storage; short prompts reach every attention kind."""

from __future__ import annotations

import json
import time

import pytest
import torch

from helpers import cli_here
from kconvert.family.manifest import bind
from kconvert.fixtures import PRESETS, build_fixture
from kconvert.fixtures.models.dsv4 import build_v4_model, reference_of, released_tensors
from kconvert.source.checkpoint import Checkpoint


@pytest.fixture(scope="module")
def model():
    return build_v4_model(0)


def test_presets_listed():
    assert "tiny-dsv4" in PRESETS and "tiny-dsv4-flash" in PRESETS


def test_every_transformers_tensor_written_once_and_read_back_equal(checkpoint, model):
    src = checkpoint("tiny-dsv4")
    ck = Checkpoint.open(src)
    ck.validate()
    state = model.state_dict()
    seen = {k: torch.zeros(v.shape, dtype=torch.int8) for k, v in state.items()}
    mtp = 0
    for name in ck.logical:
        info = ck.info(name)
        if info.component == "mtp":
            mtp += 1
            continue
        ref, index = reference_of(info, state)
        assert torch.equal(ck.read(name).to(state[ref].dtype), state[ref][index]), name
        seen[ref][index] += 1
    assert all(bool((c == 1).all()) for c in seen.values())
    assert mtp > 0 and not any(n.startswith("model.") for n in ck.logical)  # released naming, MTP included


def test_released_dtypes(checkpoint):
    ck = Checkpoint.open(checkpoint("tiny-dsv4"))
    dtype = {n: t.main.dtype for n, t in ck.logical.items()}
    assert dtype["layers.0.ffn.gate.tid2eid"] == "I64"
    for f32 in ("hc_head_fn", "layers.1.hc_ffn_scale", "layers.0.attn.attn_sink", "layers.1.attn.compressor.ape",
                "layers.3.ffn.gate.bias", "mtp.0.hc_attn_base"):
        assert dtype[f32] == "F32", f32
    for bf16 in ("embed.weight", "layers.0.attn_norm.weight", "layers.1.attn.compressor.wkv.weight",
                 "layers.1.attn.indexer.weights_proj.weight", "layers.2.ffn.experts.1.w3.weight"):
        assert dtype[bf16] == "BF16", bf16


def test_transformers_loads_the_released_names(checkpoint, model):
    """transformers' own conversion_mapping (released -> module names) finds every tensor, MTP ignored."""
    from transformers import DeepseekV4ForCausalLM

    loaded, info = DeepseekV4ForCausalLM.from_pretrained(checkpoint("tiny-dsv4"), dtype=torch.bfloat16,
                                                         output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    want = model.state_dict()
    for name, t in loaded.state_dict().items():
        assert torch.equal(t.to(want[name].dtype), want[name]), name


def test_flash_is_the_same_weights_quantized(checkpoint):
    bf16, flash = Checkpoint.open(checkpoint("tiny-dsv4")), Checkpoint.open(checkpoint("tiny-dsv4-flash"))
    flash.validate()
    assert set(bf16.logical) == set(flash.logical)
    config = json.loads((checkpoint("tiny-dsv4-flash") / "config.json").read_text())
    assert config["expert_dtype"] == "fp4" and config["quantization_config"]["scale_fmt"] == "ue8m0"
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    stored = {t.name: (t.format, t.parts["scale"].dtype if "scale" in t.parts else None) for t in flash.logical.values()}
    assert stored["layers.3.ffn.experts.7.w2.weight"] == ("fp4_packed", "F8_E8M0")
    assert stored["layers.1.attn.wq_b.weight"] == ("block_fp8", "F8_E8M0")
    assert stored["mtp.0.h_proj.weight"] == ("block_fp8", "F8_E8M0")
    assert stored["layers.1.attn.indexer.weights_proj.weight"][0] == "plain"
    for name, t in bf16.logical.items():
        a, b = bf16.read(name, dtype=torch.float32), flash.read(name, dtype=torch.float32)
        if flash.logical[name].format == "plain":
            assert torch.equal(a, b), name
        else:  # fp8 keeps ~2^-4 relative per element, fp4 ~2^-2 of its group's largest
            tol = 0.26 if flash.logical[name].format == "fp4_packed" else 0.07
            assert (a - b).abs().max() <= tol * a.abs().max(), name


def test_short_prompts_reach_every_attention_kind(model):
    cfg = model.config
    assert set(cfg.layer_types) == {"sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"}
    longest_rate = max(cfg.compress_rates.values())
    assert longest_rate <= 8 and cfg.sliding_window <= 8  # a 16-token prompt has compressed entries in every kind
    assert cfg.mlp_layer_types[:2] == ["hash_moe", "hash_moe"]
    ids = torch.randint(0, cfg.vocab_size, (1, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, 17, cfg.vocab_size) and bool(torch.isfinite(logits).all())


def test_build_is_fast_and_deterministic(tmp_path):
    t0 = time.perf_counter()
    a = build_fixture("tiny-dsv4-flash", tmp_path / "a")
    elapsed = time.perf_counter() - t0
    b = build_fixture("tiny-dsv4-flash", tmp_path / "b")
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files)
    assert elapsed < 60  # a few seconds on 2 cores; generous for a loaded machine


def test_mapping_is_refused_when_a_reference_is_wrong(model):
    cfg = json.loads(json.dumps(model.config.to_dict()))
    cfg["architectures"] = ["DeepseekV4ForCausalLM"]
    mm = bind(cfg)
    rule = next(r for r in mm.parts[1].rules if r.pattern.endswith("attn.wq_b.weight"))
    object.__setattr__(rule, "reference", "model.layers.{L}.self_attn.q_a_proj.weight")  # two names onto one
    with pytest.raises(Exception, match="not written exactly once"):
        released_tensors(model, mm, 0)


@pytest.mark.parametrize("preset", ["tiny-dsv4", "tiny-dsv4-flash"])
def test_inspect_shows_v4_components(checkpoint, preset):
    proc = cli_here("inspect", checkpoint(preset), "--json")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["family"] == "deepseek_v4"
    for c in ("attention", "compressor", "indexer", "mhc", "router", "hash_router", "routed_experts", "mtp"):
        assert summary["params"].get(c, 0) > 0, c
    assert summary["model"]["layer_kinds"] == {
        "attn_kind": {"sliding_attention": 1, "compressed_sparse_attention": 2, "heavily_compressed_attention": 1},
        "mlp_kind": {"hash_moe": 2, "moe": 2}}


def test_trained_v4_learns_and_distils_its_indexers(monkeypatch, checkpoint, tmp_path):
    """tiny-dsv4-trained with the recipe cut to a few steps (the full run takes minutes: bench/verify_bench.py
    measures on it): the language model's loss falls, the CSA indexers' distillation KL falls (their
    top-k is trained from the main attention, which language-model training cannot reach), and the
    checkpoint holds the trained weights under the released names with its training record."""
    from kconvert.fixtures.training import text as trained

    from kconvert.fixtures.training import mtp as trained_mtp

    monkeypatch.setattr(trained, "STEPS", 12)
    monkeypatch.setitem(trained.RECIPE_OVERRIDES, "tiny-dsv4", {"indexer_steps": 6})
    monkeypatch.setattr(trained_mtp, "STEPS", 6)  # its MTP block's training too
    out = build_fixture("tiny-dsv4-trained", tmp_path / "t", seed=5)  # seed 5: not the session's cached training
    rec = json.loads((out / "kconvert_training.json").read_text())
    assert rec["loss_last"] < rec["loss_first"] - 2 and rec["indexer_steps"] == 6, rec
    assert rec["indexer_kl_last"] < rec["indexer_kl_first"], rec
    assert rec["mtp_steps"] == 6 and rec["mtp_kl_last"] < rec["mtp_kl_first"], rec
    assert json.loads((out / "config.json").read_text())["kconvert_prompts"] == "stdlib-heldout"
    got, seeded = Checkpoint.open(out), Checkpoint.open(checkpoint("tiny-dsv4"))
    assert set(got.logical) == set(seeded.logical)
    for name in ("layers.1.attn.indexer.wq_b.weight", "layers.2.ffn.experts.3.w1.weight", "embed.weight"):
        assert not torch.equal(got.read(name), seeded.read(name)), name
