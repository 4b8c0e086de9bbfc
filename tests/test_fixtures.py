"""kconvert.fixtures: real-format tiny checkpoints that transformers itself loads."""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

import pytest
import torch

from kconvert.errors import UsageError
from kconvert.fixtures import PRESETS, build_fixture

SCALE_SIZE = 64_000_000
FP8_LIKE = {"tiny-k3-fp8", "tiny-k3-int4"}


# ---------------------------------------------------------------- helpers (independent of the code under test)
def read_header(path: Path) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def read_all(ckpt: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(ckpt.glob("model-*.safetensors")):
        out.update(load_file(f))
    return out


def build(checkpoint, preset: str) -> Path:
    return checkpoint(preset, size=SCALE_SIZE) if preset == "scale" else checkpoint(preset)


# ---------------------------------------------------------------- API
def test_presets_listed():
    assert set(PRESETS) == {"tiny-k3", "tiny-dsv32", "tiny-k3-fp8", "tiny-k3-int4", "small-k3", "scale",
                            "tiny-k3-4l", "tiny-dsv32-4l",
                            "tiny-k3-trained", "tiny-dsv32-trained", "tiny-k3-trained-wide"}
    assert all(isinstance(v, str) and v and "\n" not in v for v in PRESETS.values())


def test_bad_arguments(tmp_path):
    with pytest.raises(UsageError):
        build_fixture("tiny-k9", tmp_path / "a")
    with pytest.raises(UsageError):
        build_fixture("tiny-k3", tmp_path / "a", size=1000)
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
    import kconvert.fixtures.checkpoint as ck

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
@pytest.mark.parametrize("preset", ["tiny-k3", "tiny-dsv32", "tiny-k3-fp8", "tiny-k3-int4", "scale"])
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
    names = set(json.loads((checkpoint("tiny-k3") / "model.safetensors.index.json").read_text())["weight_map"])
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


# ---------------------------------------------------------------- transformers round trip
def _load(cls_name: str, path: Path, dtype=torch.bfloat16):
    import transformers

    if cls_name == "Kimi_K25ForConditionalGeneration":
        from transformers.models.kimi_k25 import Kimi_K25ForConditionalGeneration as cls
    else:
        cls = getattr(transformers, cls_name)
    return cls.from_pretrained(path, output_loading_info=True, dtype=dtype)


@pytest.mark.parametrize(
    "preset,cls_name",
    [("tiny-k3", "Kimi_K25ForConditionalGeneration"), ("tiny-dsv32", "DeepseekV32ForCausalLM")],
)
def test_transformers_round_trip(checkpoint, preset, cls_name):
    from kconvert.fixtures.hf_build import build_model

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
    from kconvert.fixtures.hf_build import build_model

    tensors = read_all(checkpoint("tiny-k3"))
    model = build_model("tiny-k3")
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
    from kconvert.fixtures.scale import plan, text_config

    d, layers = plan(8_000_000_000)
    cfg = text_config(d, layers)
    assert d == 1 and layers >= 5
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["q_lora_rank"], cfg["kv_lora_rank"]) == (7168, 128, 1536, 512)
    assert (cfg["intermediate_size"], cfg["moe_intermediate_size"], cfg["index_n_heads"]) == (18432, 2048, 64)


# ---------------------------------------------------------------- quantized sources
FP8_KEEP = re.compile(r"(mlp\.gate\.weight|indexer\.weights_proj\.weight|norm\.weight)$")


def test_fp8_layout_and_values(checkpoint):
    fp8 = read_all(checkpoint("tiny-k3-fp8"))
    ref = read_all(checkpoint("tiny-k3"))
    n_quant = 0
    for name, w in ref.items():
        is_target = w.ndim == 2 and ".model.layers." in name and not FP8_KEEP.search(name)
        if not is_target:
            assert torch.equal(fp8[name], w), name  # untouched, same bytes
            assert name[:-7] + ".weight_scale_inv" not in fp8
            continue
        n_quant += 1
        q, s = fp8[name], fp8[name[:-7] + ".weight_scale_inv"]
        assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
        rows, cols = w.shape
        assert s.shape == (-(-rows // 128), -(-cols // 128))
        scale = s.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
        deq = q.float() * scale
        err = (deq - w.float()).abs()
        # e4m3: 3 mantissa bits (relative half-ulp 2^-4), subnormal step 2^-9 (times the block scale)
        assert (err <= w.float().abs() * 2**-4 + scale * 2**-9 + 1e-12).all(), name
    # per layer: 5 MLA projections + indexer wq_b, wk; layer 0 dense MLP (3), layers 1-2: 16 experts x 3 + shared (3)
    assert n_quant == (7 + 3) + 2 * (7 + 16 * 3 + 3)
    cfg = json.loads((checkpoint("tiny-k3-fp8") / "config.json").read_text())
    qc = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
    assert cfg["quantization_config"] == qc and cfg["text_config"]["quantization_config"] == qc


def test_fp8_loads_in_transformers(checkpoint):
    # transformers' FineGrainedFP8 quantizer needs `accelerate`; on a CPU-only machine it then
    # dequantizes to bf16 on load. Without accelerate it refuses (ImportError) before reading.
    pytest.importorskip("accelerate")
    model, info = _load("Kimi_K25ForConditionalGeneration", checkpoint("tiny-k3-fp8"))
    assert not info["missing_keys"] and not info["unexpected_keys"]


def _unpack_nibbles(packed: torch.Tensor, cols: int) -> torch.Tensor:
    words = packed.to(torch.int64) & 0xFFFFFFFF
    nib = torch.stack([(words >> (4 * i)) & 0xF for i in range(8)], dim=-1)
    return nib.reshape(packed.shape[0], -1)[:, :cols] - 8


def test_int4_layout_and_values(checkpoint):
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    int4 = read_all(checkpoint("tiny-k3-int4"))
    ref = read_all(checkpoint("tiny-k3"))
    experts = [n for n in ref if re.search(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$", n)]
    assert len(experts) == 2 * 16 * 3
    for name, w in ref.items():
        if name not in experts:
            assert torch.equal(int4[name], w), name
    for name in experts:
        w, stem = ref[name].float(), name[: -len(".weight")]
        packed, scale, shape = int4[stem + ".weight_packed"], int4[stem + ".weight_scale"], int4[stem + ".weight_shape"]
        assert name not in int4
        rows, cols = w.shape
        assert packed.dtype == torch.int32 and packed.shape == (rows, cols // 8)
        assert scale.dtype == torch.bfloat16 and scale.shape == (rows, cols // 32)
        assert shape.dtype == torch.int32 and shape.tolist() == [rows, cols]
        q = _unpack_nibbles(packed, cols)
        assert torch.equal(unpack_from_int32(packed, 4, torch.Size([rows, cols])).to(torch.int64), q)
        deq = (q.float().view(rows, -1, 32) * scale.float()[..., None]).view(rows, cols)
        # half a step, plus what rounding the scale to bf16 (2^-8 relative) costs at the clamped end (+7.5 steps)
        assert ((deq - w).abs() <= scale.float().repeat_interleave(32, 1) * (0.5 + 2**-5)).all(), name
    cfg = json.loads((checkpoint("tiny-k3-int4") / "config.json").read_text())
    for qc in (cfg["quantization_config"], cfg["text_config"]["quantization_config"]):
        assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
        weights = qc["config_groups"]["group_0"]["weights"]
        assert (weights["num_bits"], weights["type"], weights["strategy"], weights["group_size"]) == (4, "int", "group", 32)
        assert weights["symmetric"] is True and qc["config_groups"]["group_0"]["targets"] == ["Linear"]


def test_int4_loads_in_transformers(checkpoint):
    """transformers (+ compressed-tensors) loads the INT4 experts on CPU, dequantized into its fused experts."""
    from kconvert.fixtures.hf_build import build_model

    model, info = _load("Kimi_K25ForConditionalGeneration", checkpoint("tiny-k3-int4"))
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ref, got = build_model("tiny-k3").state_dict(), model.state_dict()
    for k in ref:
        if ".experts." in k:
            step = ref[k].float().abs().amax() / 7.5
            assert (got[k].float() - ref[k].float()).abs().max() <= step * 0.54, k
        else:
            assert torch.equal(ref[k].to(got[k].dtype), got[k]), k


# ---------------------------------------------------------------- determinism, logits
def test_deterministic(tmp_path, checkpoint):
    a = checkpoint("tiny-k3")
    b = build_fixture("tiny-k3", tmp_path / "again", seed=0)
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


def _logits(model, ids, hook_routers=False):
    chosen: dict[int, list] = {}
    hooks = []
    if hook_routers:
        for i, layer in enumerate(model.model.language_model.layers):
            if hasattr(layer.mlp, "gate"):
                hooks.append(layer.mlp.gate.register_forward_hook(lambda m, a, out, i=i: chosen.setdefault(i, []).append(out[2])))
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    for h in hooks:
        h.remove()
    return logits, chosen


def test_logits_are_not_degenerate_and_router_spreads(checkpoint):
    model, _ = _load("Kimi_K25ForConditionalGeneration", checkpoint("tiny-k3"), dtype=torch.float32)
    ids = torch.randint(0, 768, (4, 64), generator=torch.Generator().manual_seed(0))
    logits, chosen = _logits(model, ids, hook_routers=True)
    vocab = logits.shape[-1]
    assert torch.isfinite(logits).all()
    top1 = logits.softmax(-1).amax(-1).mean().item()
    assert 20 / vocab <= top1 <= 0.9
    n_experts = model.config.text_config.n_routed_experts
    assert len(chosen) == 2
    for i, picks in chosen.items():
        counts = torch.bincount(torch.cat(picks).flatten(), minlength=n_experts)
        assert (counts > 0).sum() >= n_experts * 3 // 4, (i, counts)
        assert counts.max() <= 0.25 * counts.sum(), (i, counts)
    # Quantization is measurable: INT4 experts move the logits a little, not a lot.
    int4_model, _ = _load("Kimi_K25ForConditionalGeneration", checkpoint("tiny-k3-int4"), dtype=torch.float32)
    logp, logq = logits.log_softmax(-1), _logits(int4_model, ids)[0].log_softmax(-1)
    kld = (logp.exp() * (logp - logq)).sum(-1).mean().item()
    same_top1 = (logp.argmax(-1) == logq.argmax(-1)).float().mean().item()
    assert 1e-3 < kld < 0.3 and same_top1 > 0.7, (kld, same_top1)


# ---------------------------------------------------------------- tokenizer
def test_tokenizer(checkpoint):
    from kconvert.source.tokenizer import load_kimi_tokenizer

    ck = checkpoint("tiny-k3")
    enc = load_kimi_tokenizer(ck)
    config = json.loads((ck / "config.json").read_text())
    assert enc.n_vocab == 1024 == config["text_config"]["vocab_size"]
    base = 768
    expected = {
        "[BOS]": 0, "[EOS]": 1, "<|im_end|>": 2, "<|im_user|>": 3, "<|im_assistant|>": 4, "<|im_system|>": 10,
        "<|im_middle|>": 17, "<|media_begin|>": 18, "<|media_content|>": 19, "<|media_end|>": 20,
        "<|media_pad|>": 21, "[PAD]": 255,
    }  # offsets from 163584 in the release
    for tok, off in expected.items():
        assert enc.encode(tok, allowed_special="all") == [base + off], tok
    assert enc.encode("<|reserved_token_773|>", allowed_special="all") == [773]
    assert config["image_token_id"] == base + 21
    assert config["vision_start_token_id"] == base + 18 and config["vision_end_token_id"] == base + 20
    assert config["text_config"]["bos_token_id"] == base and config["text_config"]["eos_token_id"] == base + 1
    for text in ["Hello, world! The model reads a prompt.", "def f(x):\n    return x * 2\n", "naïve café 你好 🙂", ""]:
        ids = enc.encode(text)
        assert enc.decode(ids) == text
    assert len(enc.encode("The model reads a prompt, one token at a time")) < 20  # merges were learned
    lines = (ck / "tiktoken.model").read_text().splitlines()
    assert len(lines) == base and all(re.fullmatch(r"[A-Za-z0-9+/=]+ \d+", line) for line in lines)
    cfg = json.loads((ck / "tokenizer_config.json").read_text())
    assert len(cfg["added_tokens_decoder"]) == 256
    assert cfg["added_tokens_decoder"][str(base + 2)]["content"] == "<|im_end|>"
    assert (cfg["bos_token"], cfg["eos_token"], cfg["pad_token"]) == ("[BOS]", "[EOS]", "[PAD]")
    # transformers reads the same files (it converts tiktoken.model itself) and agrees
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(ck)
    for text in ["Hello world<|im_end|>", "HELLO it's 12345 naïve 你好\n\n  x", "def f(x):\n    return x * 2\n"]:
        assert hf.encode(text, add_special_tokens=False) == enc.encode(text, allowed_special="all"), text
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (base, base + 1, base + 255)


def test_chat_template(checkpoint):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    cfg = json.loads((checkpoint("tiny-k3") / "tokenizer_config.json").read_text())
    template = ImmutableSandboxedEnvironment().from_string(cfg["chat_template"])
    messages = [
        {"role": "system", "content": "You are Kimi."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
        {"role": "assistant", "content": "A cat."},
        {"role": "user", "content": "Thanks"},
    ]
    text = template.render(messages=messages, add_generation_prompt=True)
    assert text == (
        "<|im_system|>system<|im_middle|>You are Kimi.<|im_end|>"
        "<|im_user|>user<|im_middle|><|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
        "What is this?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>A cat.<|im_end|>"
        "<|im_user|>user<|im_middle|>Thanks<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>"
    )


# ---------------------------------------------------------------- small-k3 (~10-15 s on 2 cores)
@pytest.mark.skipif(bool(os.environ.get("KCONVERT_FAST")), reason="KCONVERT_FAST set: small-k3 not built")
def test_small_k3(checkpoint):
    """Same architecture as tiny-k3 (whose transformers round trip is tested above), ~200M parameters."""
    from kconvert.fixtures.published_names import KIMI_PATTERN

    ck = checkpoint("small-k3")
    index = json.loads((ck / "model.safetensors.index.json").read_text())
    assert all(KIMI_PATTERN.match(n) for n in index["weight_map"])
    assert 150e6 <= index["metadata"]["total_size"] / 2 <= 250e6
    config = json.loads((ck / "config.json").read_text())["text_config"]
    for key in ("hidden_size", "q_lora_rank", "kv_lora_rank", "intermediate_size", "moe_intermediate_size"):
        assert config[key] % 128 == 0, key
