"""Checkpoint reader, manifests and `kconvert inspect`: lazy reads, both source dequantizations against
independent computations, hub offline mode, and every bad input of issue 2 (one line, exit 2)."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch

from helpers import assert_one_line_error, header_offsets, load_source, run_cli
from kconvert.io import safetensors_read as safetensors_file
from kconvert.source.checkpoint import Checkpoint


def test_inspect_counts_match_transformers_model(checkpoint):
    src = checkpoint("tiny-k3")
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
    fp8 = json.loads(run_cli("inspect", checkpoint("tiny-k3-fp8"), "--json", check=True).stdout)
    assert {f["format"] for f in fp8["formats"]} >= {"block_fp8", "plain"}
    int4 = json.loads(run_cli("inspect", checkpoint("tiny-k3-int4"), "--json", check=True).stdout)
    assert any(f["format"] == "int4_packed" for f in int4["formats"])
    bf16 = json.loads(run_cli("inspect", checkpoint("tiny-k3"), "--json", check=True).stdout)
    assert fp8["total_params"] == int4["total_params"] == bf16["total_params"]


def test_block_fp8_dequant_matches_independent_computation(checkpoint):
    src = checkpoint("tiny-k3-fp8")
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

    src = checkpoint("tiny-k3-int4")
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
    ck = Checkpoint.open(checkpoint("tiny-k3"))
    seen = []
    real = safetensors_file.map_range
    monkeypatch.setattr(safetensors_file, "map_range", lambda p, b, n, **k: seen.append(n) or real(p, b, n, **k))
    name = "language_model.model.embed_tokens.weight"
    x = ck.read(name, rows=(10, 20))
    assert x.shape[0] == 10 and seen == [10 * x.shape[1] * 2]  # only those rows' bytes


def test_hub_repo_id_from_cache_and_offline_errors(checkpoint, tmp_path):
    cache = tmp_path / "hub"
    snap = cache / "models--kimi--tiny-k3" / "snapshots" / ("a" * 40)
    shutil.copytree(checkpoint("tiny-k3"), snap)
    (cache / "models--kimi--tiny-k3" / "refs").mkdir()
    (cache / "models--kimi--tiny-k3" / "refs" / "main").write_text("a" * 40)
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    r = run_cli("inspect", "kimi/tiny-k3", "--json", env=env, check=True)
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
    src = copy_checkpoint(checkpoint("tiny-k3"))
    (src / "config.json").unlink()
    assert_one_line_error(run_cli("inspect", src), "config.json")


def test_index_names_missing_file(checkpoint, copy_checkpoint):
    src = copy_checkpoint(checkpoint("tiny-k3"))
    f = _file_of(src, Q_B)
    f.unlink()
    assert_one_line_error(run_cli("inspect", src), f.name)


@pytest.mark.parametrize("bad", ["../escape.safetensors", "/etc/passwd"])
def test_index_with_unsafe_path(checkpoint, copy_checkpoint, bad):
    src = copy_checkpoint(checkpoint("tiny-k3"))
    index = _index(src)
    index["weight_map"][Q_B] = bad
    _write_index(src, index)
    assert_one_line_error(run_cli("inspect", src), bad, Q_B)


def test_truncated_file(checkpoint, copy_checkpoint):
    src = copy_checkpoint(checkpoint("tiny-k3"))
    f = _file_of(src, Q_B)
    f.write_bytes(f.read_bytes()[:-100])
    assert_one_line_error(run_cli("inspect", src), f.name, "truncated")


def test_header_not_json(checkpoint, copy_checkpoint):
    src = copy_checkpoint(checkpoint("tiny-k3"))
    f = _file_of(src, Q_B)
    data = bytearray(f.read_bytes())
    data[8] = ord("#")
    f.write_bytes(bytes(data))
    assert_one_line_error(run_cli("inspect", src), f.name, "JSON")


def test_offsets_past_file(checkpoint, copy_checkpoint):
    src = copy_checkpoint(checkpoint("tiny-k3"))
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
    src = copy_checkpoint(checkpoint("tiny-k3"))
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
    src = copy_checkpoint(checkpoint("tiny-k3"))
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


# ---------------------------------------------------------------- offsets must tile the data region (issue 10)


def _rewrite_header(f: Path, edit) -> None:
    """Apply `edit(header)` to a file's header, keeping its data bytes as they are."""
    start, header = header_offsets(f)
    data = f.read_bytes()[start:]
    edit(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def _two_same_size(header: dict) -> tuple[str, str]:
    """Two tensors of one file with the same byte size, the second after the first."""
    by_size: dict[int, list[str]] = {}
    for name, spec in header.items():
        if name != "__metadata__":
            lo, hi = spec["data_offsets"]
            by_size.setdefault(hi - lo, []).append(name)
    a, b = next(v for v in by_size.values() if len(v) >= 2)[:2]
    return (a, b) if header[a]["data_offsets"] < header[b]["data_offsets"] else (b, a)


@pytest.mark.parametrize("damage,needle", [("alias", "overlap"), ("overlap", "overlap"), ("gap", "gap"),
                                           ("trailing", "after the last tensor")])
def test_offsets_must_tile_the_data_region(checkpoint, copy_checkpoint, damage, needle):
    src = copy_checkpoint(checkpoint("tiny-k3"))
    f = _file_of(src, Q_B)
    if damage == "trailing":
        with open(f, "ab") as out:
            out.write(b"\0" * 64)
    else:
        _, header = header_offsets(f)
        first, second = _two_same_size(header)

        def edit(h: dict) -> None:
            lo, hi = h[first]["data_offsets"]
            if damage == "alias":  # two names, one region: the second's bytes become unreachable
                h[second]["data_offsets"] = [lo, hi]
            elif damage == "overlap":  # shifted half-way into its neighbour, same length
                last = max(s["data_offsets"][1] for k, s in h.items() if k != "__metadata__")
                shift = (hi - lo) // 2
                for s in h.values():
                    if isinstance(s, dict) and "data_offsets" in s and s["data_offsets"][0] > lo:
                        s["data_offsets"] = [s["data_offsets"][0] - shift, s["data_offsets"][1] - shift]
                assert last > lo
            else:  # gap: a first tensor moved later, bytes before it unowned (file length unchanged)
                h[first]["data_offsets"] = [lo + 2, hi + 2]
        _rewrite_header(f, edit)
    with pytest.raises(safetensors_file.FormatError) as e:
        Checkpoint.open(src)
    assert needle in e.value.one_line() and f.name in e.value.one_line()
    with pytest.raises(Exception):  # the safetensors library refuses the same file
        from safetensors import safe_open

        with safe_open(f, "pt") as g:
            [g.get_tensor(k) for k in g.keys()]
    if damage == "alias":  # and the user sees one line
        assert_one_line_error(run_cli("inspect", src), f.name, needle)


def test_files_the_safetensors_library_writes_are_accepted(tmp_path):
    from safetensors.torch import save_file

    tensors = {"a": torch.randn(3, 5), "empty": torch.empty(0, 4), "b": torch.randn(7).to(torch.bfloat16),
               "zero_d": torch.tensor(1.5), "c": torch.arange(9, dtype=torch.int32), "d": torch.empty(0, dtype=torch.int8)}
    save_file(tensors, tmp_path / "x.safetensors", metadata={"format": "pt", "k": "v"})
    save_file({}, tmp_path / "none.safetensors")
    header = safetensors_file.read_header(tmp_path / "x.safetensors")
    for name, t in tensors.items():
        assert torch.equal(safetensors_file.read_tensor(header.tensors[name]), t), name
    assert safetensors_file.read_header(tmp_path / "none.safetensors").tensors == {}


def _poke(f: Path, tensor: str, value_bytes: bytes, element: int = 0) -> None:
    """Overwrite element `element` of `tensor` in file `f` with raw bytes."""
    start, header = header_offsets(f)
    lo, _ = header[tensor]["data_offsets"]
    with open(f, "r+b") as out:
        out.seek(start + lo + element * len(value_bytes))
        out.write(value_bytes)


def _bytes_of(value: float, dtype: torch.dtype) -> bytes:
    return torch.tensor([value]).to(dtype).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("preset,tensor,value_bytes", [
    ("tiny-k3", "language_model.model.norm.weight", _bytes_of(float("nan"), torch.bfloat16)),
    ("tiny-k3", "language_model.lm_head.weight", _bytes_of(float("-inf"), torch.bfloat16)),
    ("tiny-k3", "language_model.model.layers.1.mlp.gate.e_score_correction_bias", _bytes_of(float("inf"), torch.float32)),
    ("tiny-k3-fp8", "language_model.model.layers.1.self_attn.q_b_proj.weight_scale_inv",
     _bytes_of(float("nan"), torch.float32)),
    ("tiny-k3-fp8", "language_model.model.layers.1.self_attn.q_b_proj.weight", b"\x7f"),  # e4m3fn NaN
    ("tiny-k3-int4", "language_model.model.layers.1.mlp.experts.3.down_proj.weight_scale",
     _bytes_of(float("inf"), torch.bfloat16)),
])
def test_non_finite_source_values_refused_on_read(checkpoint, copy_checkpoint, preset, tensor, value_bytes):
    from kconvert.errors import NonFiniteError

    src = copy_checkpoint(checkpoint(preset))
    f = _file_of(src, tensor)
    _poke(f, tensor, value_bytes, element=3)
    ck = Checkpoint.open(src)
    logical = next(n for n in ck.logical if tensor == n or tensor.startswith(n + "_"))  # weight_scale(_inv) -> weight
    with pytest.raises(NonFiniteError) as e:
        ck.read(logical)
    assert e.value.tensor == tensor and e.value.file == str(f)


def test_large_tensors_are_mapped_copy_on_write_and_truncation_is_an_error(tmp_path):
    """Tensors of MAP_AT_LEAST bytes and more are mapped from the page cache (io/pread.py): the values are
    the stored ones (whole and row ranges), writing to the tensor never reaches the file, and a file that
    shrank after its header was read is a one-line FormatError, not a crash."""
    from safetensors.torch import save_file

    from kconvert.errors import FormatError
    from kconvert.io.pread import MAP_AT_LEAST

    rows = MAP_AT_LEAST // (2 * 512) + 7  # bf16 [rows, 512]: just over the mapping threshold
    big = torch.randn(rows, 512, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    small = torch.randn(3, 5)
    f = tmp_path / "m.safetensors"
    save_file({"a_small": small, "big": big}, str(f))
    before = f.read_bytes()
    h = safetensors_file.read_header(f)
    t = safetensors_file.read_tensor(h.tensors["big"])
    assert torch.equal(t, big) and torch.equal(safetensors_file.read_tensor(h.tensors["a_small"]), small)
    assert torch.equal(safetensors_file.read_tensor(h.tensors["big"], (5, rows - 1)), big[5:rows - 1])
    t.mul_(2)  # private pages: the file keeps its bytes
    del t
    assert f.read_bytes() == before
    os.truncate(f, len(before) - 4096)
    with pytest.raises(FormatError, match="truncated") as e:
        safetensors_file.read_tensor(h.tensors["big"])
    assert e.value.tensor == "big" and e.value.file == str(f)
