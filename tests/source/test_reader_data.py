"""A source shard's data region (issue 10): tensor offsets must tile it exactly (no alias, overlap, gap or
trailing bytes), files the safetensors library writes are accepted, non-finite values are refused on
read, and large tensors are mapped copy-on-write (a truncated file is an error, not a crash). Header faults in a
5,000-tensor header (read by whole-list checks) are named exactly as the entry-by-entry walk names them."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch

from helpers import assert_one_line_error, header_offsets, run_cli
from kconvert.io import header_entries, typed_json
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
    src = copy_checkpoint(checkpoint("tiny-k25-dsv32"))
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



def _many(f: Path, n: int = 5000, reverse: bool = False, edit=None, extra: int = 0) -> None:
    """A shard of n + 2 tensors written byte by byte (big enough for read_header's whole-list path): "first" U8[1]
    at [0, 1], "scalar" F32[] after it, then "t.{i}" F32[2, 2]; `edit(specs)` damages it after offsets are set."""
    layout = [("first", "U8", [1]), ("scalar", "F32", [])] + [(f"t.{i}", "F32", [2, 2]) for i in range(n)]
    specs, pos = {}, 0
    for name, dtype, shape in layout:
        size = {"U8": 1, "F32": 4}[dtype] * (shape[0] * shape[1] if len(shape) == 2 else shape[0] if shape else 1)
        specs[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + size]}
        pos += size
    if reverse:  # valid still: safetensors orders the header by offset, but readers must not rely on it
        specs = dict(reversed(specs.items()))
    if edit:
        edit(specs)
    raw = json.dumps({"__metadata__": {"format": "pt"}, **specs}).encode()  # keeps 2.0 and true as written
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(pos + extra))


def _set(name: str, key: str, value):
    return lambda specs: specs[name].__setitem__(key, value)


def _shift_all(specs: dict) -> None:
    for spec in specs.values():
        spec["data_offsets"] = [x + 4 for x in spec["data_offsets"]]


MALFORMED = "malformed header entry (shape and data_offsets must be lists of integers)"


@pytest.mark.parametrize("reverse", [False, True], ids=["in-order", "reversed"])
@pytest.mark.parametrize("edit,extra,tensor,message", [
    (_set("t.2500", "shape", [2.0, 2]), 0, "t.2500", MALFORMED),  # 2.0 == 2: same size, same hash
    (_set("t.2500", "shape", [2, True, 2]), 0, "t.2500", MALFORMED),  # True == 1
    (_set("scalar", "data_offsets", [True, 5]), 0, "scalar", MALFORMED),  # where 1 is right
    (_set("first", "data_offsets", [False, 1]), 0, "first", MALFORMED),
    (_set("scalar", "shape", {}), 0, "scalar", MALFORMED),  # tuple({}) == () would pass as a scalar
    (_set("scalar", "shape", ""), 0, "scalar", MALFORMED),
    (_set("t.2500", "dtype", ["F32"]), 0, "t.2500", "unsupported dtype ['F32']"),
    (_set("t.2500", "data_offsets", [40005, 40021, 40037]), 0, "t.2500",
     "malformed header entry (needs dtype, shape, data_offsets)"),
    (_set("t.2500", "data_offsets", [40005, 40021.0]), 0, "t.2500", MALFORMED),
    (_set("t.3000", "data_offsets", [47989, 48005]), 0, "t.3000",  # t.2999's bytes: an alias
     "data offsets [47989, 48005] overlap tensor t.2999 (aliased or overlapping data)"),
    (_set("t.3000", "data_offsets", [47997, 48013]), 0, "t.3000",
     "data offsets [47997, 48013] overlap tensor t.2999 (aliased or overlapping data)"),
    (_set("t.4999", "data_offsets", [79993, 80009]), 4, "t.4999",
     "data offsets [79993, 80009] leave a gap of 4 bytes after t.4998"),
    (_shift_all, 4, "first", "data offsets [4, 5] leave a gap of 4 bytes after the header"),
    (None, 4, None, "4 bytes after the last tensor belong to none (the header does not describe the whole file)"),
    (_set("t.4999", "shape", [2, 3]), 0, "t.4999", "holds 16 bytes but F32[2, 3] needs 24"),
    (_set("t.4999", "shape", [-2, -2]), 0, "t.4999", "invalid shape [-2, -2] or offsets [79989, 80005]"),  # 16 bytes
    (_set("t.4999", "dtype", "I32"), 0, None, None),  # not a fault: the same size
    (_set("t.4999", "dtype", "F31"), 0, "t.4999", "unsupported dtype 'F31'"),
], ids=["float-dim", "true-dim", "true-offset", "false-offset", "dict-shape", "str-shape", "list-dtype", "3-offsets",
        "float-offset", "alias", "overlap", "gap", "leading-gap", "trailing", "size", "negative-dims", "other-dtype", "unknown-dtype"])
def test_header_faults_in_a_large_header_are_named(tmp_path, reverse, edit, extra, tensor, message):
    f = tmp_path / "many.safetensors"
    _many(f, reverse=reverse, edit=edit, extra=extra)
    if message is None:
        assert safetensors_file.read_header(f).tensors["t.4999"].dtype == "I32"
        return
    with pytest.raises(safetensors_file.FormatError) as e:
        safetensors_file.read_header(f)
    if reverse and tensor == "t.3000" and "[47989," in message:  # equal spans: the later in the header is named
        tensor, message = "t.2999", message.replace("tensor t.2999", "tensor t.3000")
    assert (e.value.message, e.value.file, e.value.tensor) == (message, str(f), tensor)


def test_large_header_read_whole_list_or_walked_alike(tmp_path):
    """The same entries, in header order, whichever way the header lists them; and the typed decode, json.loads'
    whole-list checks and the entry-by-entry walk give the very same dict (a header that fails the first takes
    the second, one that fails that takes the walk)."""
    plain, reverse = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    _many(plain)
    _many(reverse, reverse=True)
    a, b = safetensors_file.read_header(plain), safetensors_file.read_header(reverse)
    assert list(a.tensors) == list(reversed(list(b.tensors))) and len(a.tensors) == 5002
    assert all(e == b.tensors[k]._replace(file=plain) for k, e in a.tensors.items())
    raw = plain.read_bytes()[8:a.data_start]
    span = a.data_start, a.size - a.data_start
    walked = header_entries.entries(plain, _no_metadata(json.loads(raw)), *span, None)
    assert list(walked.items()) == list(a.tensors.items())
    assert list(header_entries.from_json(plain, _no_metadata(json.loads(raw)), *span, None).items()) == \
        list(walked.items())
    specs, metadata = typed_json.header(raw)
    assert list(header_entries.from_typed(plain, specs, *span).items()) == list(walked.items())
    assert metadata == json.loads(raw)["__metadata__"] == a.metadata
    assert a.tensors["scalar"].shape == () and type(a.tensors["t.7"].shape[0]) is int


def _no_metadata(obj: dict) -> dict:
    del obj["__metadata__"]
    return obj


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
    ("tiny-k25-dsv32", "language_model.model.norm.weight", _bytes_of(float("nan"), torch.bfloat16)),
    ("tiny-k25-dsv32", "language_model.lm_head.weight", _bytes_of(float("-inf"), torch.bfloat16)),
    ("tiny-k25-dsv32", "language_model.model.layers.1.mlp.gate.e_score_correction_bias", _bytes_of(float("inf"), torch.float32)),
    ("tiny-k25-dsv32-fp8", "language_model.model.layers.1.self_attn.q_b_proj.weight_scale_inv",
     _bytes_of(float("nan"), torch.float32)),
    ("tiny-k25-dsv32-fp8", "language_model.model.layers.1.self_attn.q_b_proj.weight", b"\x7f"),  # e4m3fn NaN
    ("tiny-k25-dsv32-int4", "language_model.model.layers.1.mlp.experts.3.down_proj.weight_scale",
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
