"""A source shard's data region (issue 10): tensor offsets must tile it exactly (no alias, overlap, gap or
trailing bytes), files the safetensors library writes are accepted, non-finite values are refused on
read, and large tensors are mapped copy-on-write (a truncated file is an error, not a crash)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch

from helpers import assert_one_line_error, header_offsets, run_cli
from kconvert.io import safetensors_read as safetensors_file
from kconvert.source.checkpoint import Checkpoint
from test_reader import Q_B, _file_of


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
