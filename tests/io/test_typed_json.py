"""The typed decode of headers and the index (io/typed_json.py) is a fast path only: whatever a header or an index
holds, reading it gives the same entries, or the same one-line error, as the json.loads path it replaced."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from kconvert.errors import KConvertError
from kconvert.io import typed_json
from kconvert.io.compact_json import compact_json
from kconvert.io.safetensors_read import read_header
from kconvert.io.side_files import MAX_DEPTH
from kconvert.source import stored_files

A = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
B = {"dtype": "BF16", "shape": [1, 2], "data_offsets": [8, 12]}


def _outcome(fn):
    try:
        r = fn()
    except KConvertError as e:
        return "error", e.one_line()
    return "ok", r


def _both(monkeypatch, fn):
    """fn's outcome with the typed decoders, and with them declining every input (the json path)."""
    typed = _outcome(fn)
    with monkeypatch.context() as m:
        m.setattr(typed_json, "header", lambda raw: None)
        m.setattr(typed_json, "weight_map", lambda raw, files=(): None)
        plain = _outcome(fn)
    return typed, plain


def _header(path: Path, text: str | bytes, data: int = 12) -> Path:
    raw = text.encode() if isinstance(text, str) else text
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(data))
    return path


EMPTY_5000 = {f"t{i}": {**A, "shape": [0], "data_offsets": [12, 12]} for i in range(5000)}  # 333 KB of header
HEADERS = {
    "usual": json.dumps({"__metadata__": {"format": "pt"}, "a": A, "b": B}),
    "no-metadata": json.dumps({"a": A, "b": B}),
    "metadata-last-odd-values": json.dumps({"a": A, "b": B, "__metadata__": {"n": 1, "x": [1, {"y": None}]}}),
    "metadata-not-an-object": json.dumps({"__metadata__": [1], "a": A, "b": B}),
    "extra-field": json.dumps({"a": {**A, "note": {"k": [1]}}, "b": B}),
    "unicode-names": json.dumps({"é.ü": A, "名": B}, ensure_ascii=False),
    "escaped-names": json.dumps({"é.ü": A, "名": B}),
    "reversed-order": json.dumps({"b": B, "a": A}),
    "duplicate-key": '{"a": {"dtype": "F16", "shape": [4], "data_offsets": [0, 8]}, "a": ' + json.dumps(A)
                     + ', "b": ' + json.dumps(B) + "}",
    "utf-16": json.dumps({"a": A, "b": B}).encode("utf-16"),
    "lone-surrogate-name": '{"\\ud800": ' + json.dumps(A) + ', "b": ' + json.dumps(B) + "}",
    # faults: the same message either way
    "float-offset": json.dumps({"a": {**A, "data_offsets": [0, 8.0]}, "b": B}),
    "bool-dim": json.dumps({"a": {**A, "shape": [True, 2]}, "b": {**B, "shape": [2]}}),
    "unknown-dtype": json.dumps({"a": {**A, "dtype": "F33"}, "b": B}),
    "dtype-a-list": json.dumps({"a": {**A, "dtype": ["F32"]}, "b": B}),
    "missing-dtype": json.dumps({"a": {"shape": [2], "data_offsets": [0, 8]}, "b": B}),
    "null-shape": json.dumps({"a": {**A, "shape": None}, "b": B}),
    "three-offsets": json.dumps({"a": {**A, "data_offsets": [0, 8, 9]}, "b": B}),
    "huge-offset": json.dumps({"a": {**A, "data_offsets": [0, 2**64]}, "b": B}),
    "nan": json.dumps({"a": {**A, "shape": [float("nan")]}, "b": B}),
    "not-json": '{"a": ',
    "not-an-object": "[1, 2]",
    "entry-not-an-object": json.dumps({"a": [1], "b": B}),
    "deep": '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}",
    "codec-without-index": json.dumps({"__metadata__": {"kconvert_codec": "zstd"}, "a": A, "b": B}),
    # over 256 KiB: viewed through a mapping (io/safetensors_read._header_bytes), the same either way
    "large": json.dumps({"a": A, "b": B, **EMPTY_5000}),
    "large-bad-dtype": json.dumps({"a": A, "b": B, **EMPTY_5000, "z": {**A, "dtype": "F33"}}),
}


@pytest.mark.parametrize("name", list(HEADERS))
def test_header_reads_as_the_json_path_does(tmp_path, monkeypatch, name):
    f = _header(tmp_path / "x.safetensors", HEADERS[name])
    typed, plain = _both(monkeypatch, lambda: read_header(f))
    if typed[0] == "ok":
        typed = "ok", (list(typed[1].tensors.items()), typed[1].metadata)
        plain = "ok", (list(plain[1].tensors.items()), plain[1].metadata)
    assert typed == plain
    if name.startswith("large"):  # read through a mapping: taken, or refused with the json path's error
        assert (typed[0] == "ok") == (name == "large")
    if name in TYPED:  # the fast path takes the usual headers (it is not always declining)
        assert typed[0] == "ok" and len(typed[1][0]) == 2 and typed_json.header(f.read_bytes()[8:-12]) is not None


def test_typed_dtypes_are_the_tags_themselves(tmp_path):
    """Entries share one str per dtype tag (ITEMSIZE's own), so 200k entries hold a few dozen strs and compare by
    identity first (source/logical.stored_alike)."""
    from kconvert.io.dtypes import ITEMSIZE

    tags = {t: t for t in ITEMSIZE}
    specs, _ = typed_json.header(HEADERS["usual"].encode())
    assert all(s.dtype is tags[s.dtype] for s in specs.values())
    f = _header(tmp_path / "x.safetensors", HEADERS["usual"])
    assert all(e.dtype is tags[e.dtype] for e in read_header(f).tensors.values())


TYPED = ("usual", "no-metadata", "metadata-last-odd-values", "extra-field", "unicode-names", "escaped-names",
         "reversed-order", "duplicate-key")


def _index(root: Path, text: str) -> None:
    _header(root / "m.safetensors", json.dumps({"a": A, "b": B}))
    (root / stored_files.INDEX).write_text(text)


INDEXES = {
    "usual": json.dumps({"metadata": {"total_size": 12}, "weight_map": {"a": "m.safetensors", "b": "m.safetensors"}}),
    "metadata-at-the-bound": json.dumps({"metadata": json.loads("[" * (MAX_DEPTH - 1) + "]" * (MAX_DEPTH - 1)),
                                         "weight_map": {"a": "m.safetensors", "b": "m.safetensors"}}),
    "metadata-too-deep": json.dumps({"metadata": json.loads("[" * MAX_DEPTH + "]" * MAX_DEPTH),
                                     "weight_map": {"a": "m.safetensors", "b": "m.safetensors"}}),
    "number-file": json.dumps({"weight_map": {"a": "m.safetensors", "b": 7}}),
    "no-weight-map": json.dumps({"metadata": {}}),
    "null-weight-map": json.dumps({"weight_map": None}),
    "list": "[]",
    "escape": json.dumps({"weight_map": {"a": "m.safetensors", "b": "../m.safetensors"}}),
    "missing-file": json.dumps({"weight_map": {"a": "m.safetensors", "b": "n.safetensors"}}),
    "file-in-a-folder": json.dumps({"weight_map": {"a": "m.safetensors", "b": "sub/m.safetensors"}}),
    "not-json": '{"weight_map": {',
    # over 1 MiB: read through a mapping (io/side_files.mapped_bytes), the same either way
    "large": json.dumps({"weight_map": {**{f"layers.{i}.w": "m.safetensors" for i in range(60_000)},
                                        "a": "m.safetensors", "b": "m.safetensors"}}),
    "large-not-json": json.dumps({"weight_map": {f"layers.{i}.w": "m.safetensors" for i in range(60_000)}})[:-3],
}


@pytest.mark.parametrize("name", list(INDEXES))
def test_index_reads_as_the_json_path_does(tmp_path, monkeypatch, name):
    _index(tmp_path, INDEXES[name])
    typed, plain = _both(monkeypatch, lambda: stored_files.index_map_of(tmp_path))
    assert typed == plain
    if name == "usual":  # the typed decode took it, each file named by one shared str (compared by identity)
        weight_map = typed_json.weight_map((tmp_path / stored_files.INDEX).read_bytes(), ("m.safetensors",))
        assert weight_map == {"a": "m.safetensors", "b": "m.safetensors"} and weight_map["a"] is weight_map["b"]
    assert (typed[0] == "ok") == (name in ("usual", "metadata-at-the-bound", "missing-file", "file-in-a-folder",
                                                         "large"))
    if typed[0] == "ok":  # and the fast path took it
        assert typed_json.weight_map((tmp_path / stored_files.INDEX).read_bytes()) == typed[1]


@pytest.mark.parametrize("doc", [
    {"__metadata__": {"format": "pt"}, "a.w": {"dtype": "F8_E4M3", "shape": [2, 3], "data_offsets": [0, 6]}},
    {"é": [1, None, True, False, -7, 2**63, 2**70], "名": (1, 2), "ctl\x00\x1f\x7f\n\t": "\u2028\ud800", "q\"\\/": {}},
    [["a", 1, [0, 1, 2], None]] * 3,
    {},
])
def test_compact_json_is_what_json_dumps_writes(doc):
    """Headers and rank lists are encoded fast only where that is json.dumps' exact text: every conversion's
    bytes and kconvert.json's digest depend on it."""
    assert compact_json(doc) == json.dumps(doc, separators=(",", ":")).encode()


@pytest.mark.parametrize("name", ["a.w", "é", "ctl\x01"])
def test_header_entries_encode_as_the_dicts_they_replace(name):
    doc = {"__metadata__": {"format": "pt"}, name: {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}}
    assert compact_json({"__metadata__": {"format": "pt"}, name: typed_json.HeaderSpec("F32", (2, 3), (0, 24))}) == \
        json.dumps(doc, separators=(",", ":")).encode()
