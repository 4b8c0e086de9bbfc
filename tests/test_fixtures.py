"""kconvert.fixtures: real-format tiny checkpoints that transformers itself loads: presets, layout,
published names, the transformers round trip, determinism (also: test_fixtures_quantized.py, test_fixtures_model.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from fixture_files import SCALE_SIZE, load_in_transformers as _load, read_all, read_header
from kconvert.errors import UsageError
from kconvert.fixtures import PRESETS, build_fixture

FP8_LIKE = {"tiny-k25-dsv32-fp8", "tiny-k25-dsv32-int4"}


def build(checkpoint, preset: str) -> Path:
    return checkpoint(preset, size=SCALE_SIZE) if preset == "scale" else checkpoint(preset)


# ---------------------------------------------------------------- API
def test_presets_listed():
    assert set(PRESETS) == {"tiny-k25-dsv32", "tiny-dsv32", "tiny-k25-dsv32-fp8", "tiny-k25-dsv32-int4", "small-k25-dsv32", "scale",
                            "tiny-k25-dsv32-4l", "tiny-dsv32-4l", "tiny-dsv32-mtp", "tiny-dsv4", "tiny-dsv4-flash",
                            "tiny-dsv4-flash-base",
                            "tiny-k25-dsv32-trained", "tiny-dsv32-trained", "tiny-k25-dsv32-trained-wide", "topo-k25", "topo-k25-bf16",
                            "topo-dsv4-pro", "tiny-dsv4-trained", "tiny-k25-dsv4", "tiny-k25-dsv4-trained",
                            "tiny-kimi-k3", "tiny-kimi-k3-bf16", "tiny-kimi-linear", "tiny-kimi-k3-trained", "topo-kimi-k3",
                            "tiny-dsv41", "tiny-dsv4-dspark", "tiny-dsv4-dspark-trained"}
    assert all(isinstance(v, str) and v and "\n" not in v for v in PRESETS.values())


def test_bad_arguments(tmp_path):
    with pytest.raises(UsageError):
        build_fixture("tiny-k9", tmp_path / "a")
    with pytest.raises(UsageError):
        build_fixture("tiny-k25-dsv32", tmp_path / "a", size=1000)
    with pytest.raises(UsageError):
        build_fixture("scale", tmp_path / "a")
    with pytest.raises(UsageError):
        build_fixture("scale", tmp_path / "a", size=1000)  # below the smallest layout
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(UsageError):
        build_fixture("tiny-dsv32", tmp_path / "full")
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError):
        build_fixture("tiny-dsv32", tmp_path / "file")


def test_crash_leaves_nothing(tmp_path, monkeypatch):
    import kconvert.fixtures.models.k25_dsv32 as ck

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(ck, "write_kimi_tokenizer", boom)
    with pytest.raises(RuntimeError):
        build_fixture("tiny-dsv32", tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_empty_out_dir_is_accepted(tmp_path):
    (tmp_path / "out").mkdir()
    path = build_fixture("scale", tmp_path / "out", size=SCALE_SIZE)
    assert (path / "model.safetensors.index.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# ---------------------------------------------------------------- layout
@pytest.mark.parametrize("preset", ["tiny-k25-dsv32", "tiny-dsv32", "tiny-k25-dsv32-fp8", "tiny-k25-dsv32-int4", "scale"])
def test_sharded_layout(checkpoint, preset):
    ck = build(checkpoint, preset)
    files = sorted(ck.glob("*.safetensors"))
    assert len(files) >= 3
    n = len(files)
    assert [f.name for f in files] == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    index = json.loads((ck / "model.safetensors.index.json").read_text())
    headers = {f.name: read_header(f) for f in files}
    located = {name: fname for fname, h in headers.items() for name in h}
    assert index["weight_map"] == located
    sizes = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "I32": 4}
    total = 0
    for h in headers.values():
        for name, info in h.items():
            count = 1
            for d in info["shape"]:
                count *= d
            total += count * sizes[info["dtype"]]
            assert info["data_offsets"][1] - info["data_offsets"][0] == count * sizes[info["dtype"]]
    assert index["metadata"]["total_size"] == total
    # at least one text layer is spread over two files
    files_of_layer: dict[str, set] = {}
    for name, fname in located.items():
        m = re.search(r"model\.layers\.(\d+)\.", name)
        if m:
            files_of_layer.setdefault(m.group(1), set()).add(fname)
    assert any(len(fs) >= 2 for fs in files_of_layer.values())
    # dtypes as released: bf16, e_score_correction_bias float32 (+ quantized payloads)
    for name, fname in located.items():
        dtype = headers[fname][name]["dtype"]
        if name.endswith("e_score_correction_bias"):
            assert dtype == "F32"
        elif preset not in FP8_LIKE:
            assert dtype == "BF16", name
    config = json.loads((ck / "config.json").read_text())
    assert config["architectures"]
    for f in ("tiktoken.model", "tokenizer_config.json"):
        assert (ck / f).exists()
    assert not [p for p in ck.parent.iterdir() if p.name.endswith(".partial")]


def test_kimi_published_names(checkpoint):
    names = set(json.loads((checkpoint("tiny-k25-dsv32") / "model.safetensors.index.json").read_text())["weight_map"])
    L = "language_model.model.layers"
    expected = {
        "language_model.model.embed_tokens.weight",
        "language_model.model.norm.weight",
        "language_model.lm_head.weight",
        f"{L}.0.mlp.gate_proj.weight",
        f"{L}.0.self_attn.kv_a_proj_with_mqa.weight",
        f"{L}.1.self_attn.indexer.wq_b.weight",
        f"{L}.1.self_attn.indexer.k_norm.bias",
        f"{L}.1.self_attn.indexer.weights_proj.weight",
        f"{L}.1.mlp.experts.15.down_proj.weight",
        f"{L}.2.mlp.gate.e_score_correction_bias",
        f"{L}.2.mlp.shared_experts.up_proj.weight",
        "vision_tower.patch_embed.proj.weight",
        "vision_tower.patch_embed.pos_emb.weight",
        "vision_tower.encoder.blocks.1.wqkv.weight",
        "vision_tower.encoder.blocks.1.wqkv.bias",
        "vision_tower.encoder.blocks.0.norm0.weight",
        "vision_tower.encoder.blocks.0.mlp.fc1.bias",
        "vision_tower.encoder.blocks.0.wo.weight",
        "vision_tower.encoder.final_layernorm.bias",
        "mm_projector.pre_norm.weight",
        "mm_projector.proj.0.weight",
        "mm_projector.proj.2.bias",
    }
    assert expected <= names
    assert not [n for n in names if ".blocks." in n and n.startswith("language_model")]
    assert not [n for n in names if n.startswith("model.") or "encoder.patch_embed" in n]
    assert len([n for n in names if n.startswith(f"{L}.1.mlp.experts.")]) == 16 * 3



@pytest.mark.parametrize(
    "preset,cls_name",
    [("tiny-k25-dsv32", "Kimi_K25ForConditionalGeneration"), ("tiny-dsv32", "DeepseekV32ForCausalLM")],
)
def test_transformers_round_trip(checkpoint, preset, cls_name):
    from kconvert.fixtures.models.hf_build import build_model

    model, info = _load(cls_name, checkpoint(preset))
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ref = build_model(preset).state_dict()
    got = model.state_dict()
    assert set(ref) == set(got)
    for k in ref:
        assert torch.equal(ref[k].to(got[k].dtype), got[k]), k


def test_vision_wqkv_is_interleaved_rope_layout(checkpoint):
    """Published wqkv = [q; k; v] with q and k rows in MoonViT's interleaved (x0, y0, x1, y1...) order;
    transformers' q_proj/k_proj hold them half-split (x0..x_{h-1}, y0..y_{h-1}) per head."""
    from kconvert.fixtures.models.hf_build import build_model

    tensors = read_all(checkpoint("tiny-k25-dsv32"))
    model = build_model("tiny-k25-dsv32")
    heads = model.config.vision_config.num_attention_heads
    attn = model.model.vision_tower.layers[1].attn
    dim = attn.q_proj.weight.shape[0]
    head_dim = dim // heads
    for suffix in ("weight", "bias"):
        wqkv = tensors[f"vision_tower.encoder.blocks.1.wqkv.{suffix}"]
        q, k, v = wqkv.split(dim, dim=0)
        for pub, hf in ((q, getattr(attn.q_proj, suffix)), (k, getattr(attn.k_proj, suffix))):
            pub = pub.reshape(heads, head_dim // 2, 2, *pub.shape[1:])
            hf = hf.reshape(heads, 2, head_dim // 2, *hf.shape[1:])
            assert torch.equal(pub[:, :, 0], hf[:, 0]) and torch.equal(pub[:, :, 1], hf[:, 1])
        assert torch.equal(v, getattr(attn.v_proj, suffix))


def test_scale_names_and_shapes_are_what_transformers_expects(checkpoint):
    model, info = _load("DeepseekV32ForCausalLM", checkpoint("scale", size=SCALE_SIZE))
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    total = json.loads((checkpoint("scale", size=SCALE_SIZE) / "model.safetensors.index.json").read_text())
    assert SCALE_SIZE / 2 < total["metadata"]["total_size"] < SCALE_SIZE * 1.5
    logits = model(input_ids=torch.arange(12)[None]).logits
    assert torch.isfinite(logits).all()


def test_scale_uses_real_widths_when_size_allows():
    from kconvert.fixtures.models.scale import plan, text_config

    d, layers = plan(8_000_000_000)
    cfg = text_config(d, layers)
    assert d == 1 and layers >= 5
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["q_lora_rank"], cfg["kv_lora_rank"]) == (7168, 128, 1536, 512)
    assert (cfg["intermediate_size"], cfg["moe_intermediate_size"], cfg["index_n_heads"]) == (18432, 2048, 64)



# ---------------------------------------------------------------- determinism, logits
def test_deterministic(tmp_path, checkpoint):
    a = checkpoint("tiny-k25-dsv32")
    b = build_fixture("tiny-k25-dsv32", tmp_path / "again", seed=0)
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for n in names:
        assert (a / n).read_bytes() == (b / n).read_bytes(), n
    c = build_fixture("tiny-dsv32", tmp_path / "seed1", seed=1)
    assert read_all(c)["model.norm.weight"].tolist() != read_all(checkpoint("tiny-dsv32"))["model.norm.weight"].tolist()


def test_scale_deterministic(tmp_path, checkpoint):
    a = checkpoint("scale", size=SCALE_SIZE)
    b = build_fixture("scale", tmp_path / "again", size=SCALE_SIZE)
    for p in sorted(a.iterdir()):
        assert p.read_bytes() == (b / p.name).read_bytes(), p.name

