"""Checkpoint reader, manifests and `kconvert inspect`: lazy reads, both source dequantizations against
independent computations, hub offline mode, and every bad input of issue 2 (one line, exit 2).
A shard's data region (offsets, non-finite values, mapping): test_reader_data.py."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch

from helpers import assert_one_line_error, header_offsets, load_source, run_cli
from kconvert.errors import CheckpointError
from kconvert.io import safetensors_read as safetensors_file
from kconvert.source.checkpoint import Checkpoint


def test_inspect_counts_match_transformers_model(checkpoint):
    src = checkpoint("tiny-k25-dsv32")
    r = run_cli("inspect", src, "--json", check=True)
    s = json.loads(r.stdout)
    assert s["family"] == "kimi_k25"
    total = sum(t.numel() for t in load_source(src).values())
    assert s["total_params"] == total
    assert {"attention", "indexer", "routed_experts", "shared_experts", "dense_mlp", "vision", "projector",
            "embed", "head"} <= set(s["params"])
    cfg = json.loads((src / "config.json").read_text())["text_config"]
    per_expert = 3 * cfg["hidden_size"] * cfg["moe_intermediate_size"]
    moe_layers = cfg["num_hidden_layers"] - cfg["first_k_dense_replace"]
    assert s["params"]["routed_experts"] == per_expert * cfg["n_routed_experts"] * moe_layers
    routed_active = per_expert * cfg["num_experts_per_tok"] * moe_layers
    text = sum(v for k, v in s["params"].items() if k not in ("vision", "projector", "routed_experts", "mtp"))
    assert s["active_params"] == text + routed_active
    assert s["bytes_on_disk"] == sum(p.stat().st_size for p in src.glob("*.safetensors"))
    human = run_cli("inspect", src, check=True).stdout
    assert "routed_experts" in human and "kimi_k25" in human


def test_inspect_other_families_and_formats(checkpoint):
    assert json.loads(run_cli("inspect", checkpoint("tiny-dsv32"), "--json", check=True).stdout)["family"] == "deepseek_v32"
    fp8 = json.loads(run_cli("inspect", checkpoint("tiny-k25-dsv32-fp8"), "--json", check=True).stdout)
    assert {f["format"] for f in fp8["formats"]} >= {"block_fp8", "plain"}
    int4 = json.loads(run_cli("inspect", checkpoint("tiny-k25-dsv32-int4"), "--json", check=True).stdout)
    assert any(f["format"] == "int4_packed" for f in int4["formats"])
    bf16 = json.loads(run_cli("inspect", checkpoint("tiny-k25-dsv32"), "--json", check=True).stdout)
    assert fp8["total_params"] == int4["total_params"] == bf16["total_params"]


def test_block_fp8_dequant_matches_independent_computation(checkpoint):
    src = checkpoint("tiny-k25-dsv32-fp8")
    ck = Checkpoint.open(src)
    raw = load_source(src)
    names = [n for n, t in ck.logical.items() if t.format == "block_fp8"]
    assert len(names) > 20
    assert sum(ck.logical[n].shape[0] >= 200 for n in names[:12]) >= 3
    for name in names[:12]:
        w, s = raw[name], raw[name + "_scale_inv"]
        expect = torch.empty(w.shape)
        for i in range(s.shape[0]):  # block by block, the plain way
            for j in range(s.shape[1]):
                blk = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].float()
                expect[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = blk * s[i, j]
        assert torch.equal(ck.read(name), expect), name
        if w.shape[0] < 200:
            continue
        rows = (100, min(300, w.shape[0]))  # a row range that starts inside a block
        assert torch.equal(ck.read(name, rows=rows), expect[rows[0]:rows[1]]), name


def test_int4_unpack_matches_compressed_tensors(checkpoint):
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    src = checkpoint("tiny-k25-dsv32-int4")
    ck = Checkpoint.open(src)
    raw = load_source(src)
    names = [n for n, t in ck.logical.items() if t.format == "int4_packed"]
    assert len(names) == 2 * 16 * 3
    for name in names[:8]:
        base = name[: -len(".weight")]
        shape = tuple(raw[base + ".weight_shape"].tolist())
        q = unpack_from_int32(raw[base + ".weight_packed"], 4, torch.Size(shape))
        scale = raw[base + ".weight_scale"].float()
        expect = q.float() * scale.repeat_interleave(32, dim=1)
        assert torch.equal(ck.read(name), expect), name
        assert torch.equal(ck.read(name, rows=(3, 9)), expect[3:9]), name


def test_reads_are_lazy(checkpoint, monkeypatch):
    ck = Checkpoint.open(checkpoint("tiny-k25-dsv32"))
    seen = []
    real = safetensors_file.map_range
    monkeypatch.setattr(safetensors_file, "map_range", lambda p, b, n, **k: seen.append(n) or real(p, b, n, **k))
    name = "language_model.model.embed_tokens.weight"
    x = ck.read(name, rows=(10, 20))
    assert x.shape[0] == 10 and seen == [10 * x.shape[1] * 2]  # only those rows' bytes


def test_hub_repo_id_from_cache_and_offline_errors(checkpoint, tmp_path):
    cache = tmp_path / "hub"
    snap = cache / "models--kimi--tiny-k25-dsv32" / "snapshots" / ("a" * 40)
    shutil.copytree(checkpoint("tiny-k25-dsv32"), snap)
    (cache / "models--kimi--tiny-k25-dsv32" / "refs").mkdir()
    (cache / "models--kimi--tiny-k25-dsv32" / "refs" / "main").write_text("a" * 40)
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    r = run_cli("inspect", "kimi/tiny-k25-dsv32", "--json", env=env, check=True)
    assert json.loads(r.stdout)["family"] == "kimi_k25"
    assert_one_line_error(run_cli("inspect", "kimi/not-cached", env=env), "kimi/not-cached", "HF_HUB_OFFLINE")


# ------------------------------------------------------------------ bad input: one line, exit 2


def _index(src: Path) -> dict:
    return json.loads((src / "model.safetensors.index.json").read_text())


def _write_index(src: Path, index: dict) -> None:
    (src / "model.safetensors.index.json").write_text(json.dumps(index))


def _file_of(src: Path, tensor: str) -> Path:
    return src / _index(src)["weight_map"][tensor]


Q_B = "language_model.model.layers.1.self_attn.q_b_proj.weight"


def test_missing_config(checkpoint, copy_checkpoint):
    src = copy_checkpoint(checkpoint("tiny-k25-dsv32"))
    (src / "config.json").unlink()
    assert_one_line_error(run_cli("inspect", src), "config.json")


def test_index_names_missing_file(checkpoint, copy_checkpoint):
    src = copy_checkpoint(checkpoint("tiny-k25-dsv32"))
    f = _file_of(src, Q_B)
    f.unlink()
    assert_one_line_error(run_cli("inspect", src), f.name)


@pytest.mark.parametrize("bad", ["../escape.safetensors", "/etc/passwd"])
def test_index_with_unsafe_path(checkpoint, copy_checkpoint, bad):
    src = copy_checkpoint(checkpoint("tiny-k25-dsv32"))
    index = _index(src)
    index["weight_map"][Q_B] = bad
    _write_index(src, index)
    assert_one_line_error(run_cli("inspect", src), bad, Q_B)


@pytest.mark.parametrize("bad", [["x.safetensors"], 7, None, ""])
def test_index_file_name_not_a_string(checkpoint, copy_checkpoint, bad):
    src = copy_checkpoint(checkpoint("tiny-k25-dsv32"))
    index = _index(src)
    index["weight_map"][Q_B] = bad
    _write_index(src, index)
    with pytest.raises(CheckpointError) as e:
        Checkpoint.open(src)
    assert (e.value.message, e.value.tensor) == (f"file name {bad!r} is not a plain relative path", Q_B)

@pytest.mark.parametrize("damage", ["moved", "extra", "twice"])
def test_index_and_headers_disagree(checkpoint, copy_checkpoint, damage):
    """Every tensor where the index says, once, and the index naming no other: the first that is not, named."""
    src = copy_checkpoint(checkpoint("tiny-k25-dsv32"))
    index = _index(src)
    a = index["weight_map"][Q_B]
    b = next(f for f in sorted(set(index["weight_map"].values())) if f != a)
    if damage == "moved":
        index["weight_map"][Q_B] = b
        tensor, message = Q_B, f"tensor is in {a} but the index says {b}"
    elif damage == "extra":
        index["weight_map"]["language_model.model.extra.weight"] = b
        tensor, message = "language_model.model.extra.weight", f"the index places this tensor in {b}, which does not hold it"
    else:  # Q_B's bytes appended to file b, and its entry to b's header
        (sa, ha), (sb, hb) = header_offsets(src / a), header_offsets(src / b)
        lo, hi = ha[Q_B]["data_offsets"]
        data = (src / b).read_bytes()[sb:]
        hb[Q_B] = dict(ha[Q_B], data_offsets=[len(data), len(data) + hi - lo])
        raw = json.dumps(hb).encode()
        (src / b).write_bytes(struct.pack("<Q", len(raw)) + raw + data + (src / a).read_bytes()[sa + lo:sa + hi])
        tensor, message = Q_B, f"tensor stored twice (also in {a})" if a < b else f"tensor is in {b} but the index says {a}"
    _write_index(src, index)
    with pytest.raises(CheckpointError) as e:
        Checkpoint.open(src)
    assert (e.value.message, e.value.tensor) == (message, tensor)


def test_truncated_file(checkpoint, copy_checkpoint):
    src = copy_checkpoint(checkpoint("tiny-k25-dsv32"))
    f = _file_of(src, Q_B)
    f.write_bytes(f.read_bytes()[:-100])
    assert_one_line_error(run_cli("inspect", src), f.name, "truncated")


def test_header_not_json(checkpoint, copy_checkpoint):
    src = copy_checkpoint(checkpoint("tiny-k25-dsv32"))
    f = _file_of(src, Q_B)
    data = bytearray(f.read_bytes())
    data[8] = ord("#")
    f.write_bytes(bytes(data))
    assert_one_line_error(run_cli("inspect", src), f.name, "JSON")


def test_offsets_past_file(checkpoint, copy_checkpoint):
    src = copy_checkpoint(checkpoint("tiny-k25-dsv32"))
    f = _file_of(src, Q_B)
    start, header = header_offsets(f)
    data = f.read_bytes()
    lo, hi = header[Q_B]["data_offsets"]
    header[Q_B]["data_offsets"] = [lo + 10**9, hi + 10**9]
    raw = json.dumps(header).encode()
    raw += b" " * (start - 8 - len(raw)) if len(raw) <= start - 8 else b""
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + data[start:])
    assert_one_line_error(run_cli("inspect", src), f.name, Q_B, "past the end")


def test_shape_disagrees_with_config(checkpoint, copy_checkpoint):
    src = copy_checkpoint(checkpoint("tiny-k25-dsv32"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["text_config"]["q_lora_rank"] += 8
    (src / "config.json").write_text(json.dumps(cfg))
    r = run_cli("inspect", src)
    assert_one_line_error(r, "tensor language_model.model.layers.", "disagrees with config.json")
    assert ".safetensors" in r.stderr


def _rename_tensor(src: Path, old: str, new: str) -> Path:
    f = _file_of(src, old)
    start, header = header_offsets(f)
    data = f.read_bytes()
    header[new] = header.pop(old)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + data[start:])
    index = _index(src)
    index["weight_map"][new] = index["weight_map"].pop(old)
    _write_index(src, index)
    return f


def test_unknown_tensor(checkpoint, copy_checkpoint):
    src = copy_checkpoint(checkpoint("tiny-k25-dsv32"))
    unknown = "language_model.model.layers.1.self_attn.q_c_proj.weight"
    f = _rename_tensor(src, Q_B, unknown)
    assert_one_line_error(run_cli("inspect", src), f.name, unknown, "not known")


def test_required_tensor_absent_named(checkpoint, copy_checkpoint, tmp_path):
    src = copy_checkpoint(checkpoint("tiny-dsv32"))
    index = _index(src)
    name = "model.layers.2.mlp.experts.5.up_proj.weight"
    f = _file_of(src, name)
    from safetensors.torch import load_file, save_file

    tensors = load_file(f)
    del tensors[name]
    save_file(tensors, f, metadata={"format": "pt"})
    del index["weight_map"][name]
    _write_index(src, index)
    assert_one_line_error(run_cli("inspect", src), name, "absent")


def test_unknown_architecture(checkpoint, copy_checkpoint):
    src = copy_checkpoint(checkpoint("tiny-dsv32"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["LlamaForCausalLM"], "llama"
    (src / "config.json").write_text(json.dumps(cfg))
    assert_one_line_error(run_cli("inspect", src), "config.json", "LlamaForCausalLM", "no manifest")
