"""Typed JSON decoding for the two files that grow with the tensor count: safetensors headers and the index.

A released checkpoint's headers and index hold 200k+ entries each. `json.loads` builds a dict per entry that
the reader then type-checks in Python; msgspec decodes straight into fixed-field records and checks the types
in C (ints that are ints, not bools or floats; two offsets), in well under the time json.loads takes.

Both decoders are fast paths only: each returns None when the input is anything but the usual shape
(invalid JSON, a wrong type anywhere, UTF-16, a lone surrogate, deep nesting), and the caller then takes its
json.loads path, which names what is wrong exactly as before. So a file either decodes here to what json.loads
plus the caller's checks would give, or the caller's own path decides.
"""

from __future__ import annotations

import functools
from typing import Literal

import msgspec

from kconvert.io.dtypes import ITEMSIZE


_Tag = Literal[tuple(ITEMSIZE)]  # decoded as ITEMSIZE's own str: one object per tag, checked in C


class HeaderSpec(msgspec.Struct, gc=False):
    """One header entry, read or written. Read: a missing field is None (the caller refuses it); unknown fields
    are ignored, as the json path ignores them; `__metadata__` decodes as an entry with every field None.
    Written (io/safetensors_write.py, through io/compact_json.py): the object {"dtype", "shape", "data_offsets"}
    in that order, built in C, not as a dict a tensor."""

    dtype: _Tag | None = None  # a tag no dtype has: the json path names it
    shape: tuple[int, ...] | None = None
    data_offsets: tuple[int, int] | None = None


class _Metadata(msgspec.Struct, gc=False):
    metadata: object = msgspec.field(default=None, name="__metadata__")  # every other key skipped unparsed


class _Index(msgspec.Struct, gc=False):
    weight_map: dict[str, str] | None = None  # `metadata` and anything else skipped unparsed


_HEADER = msgspec.json.Decoder(dict[str, HeaderSpec])
_METADATA = msgspec.json.Decoder(_Metadata)
_INDEX = msgspec.json.Decoder(_Index)
_FAILED = (msgspec.DecodeError, RecursionError)  # ValidationError is a DecodeError


def header(raw: bytes) -> tuple[dict[str, HeaderSpec], object] | None:
    """(name -> entry without `__metadata__`, the metadata value or None), or None: take the json path."""
    try:
        specs = _HEADER.decode(raw)
        meta = _METADATA.decode(raw).metadata if "__metadata__" in specs else None
    except _FAILED:
        return None
    specs.pop("__metadata__", None)
    return specs, meta


def weight_map(raw: bytes, files: tuple[str, ...] = ()) -> dict[str, str] | None:
    """The index's weight_map when it is an object of strings, or None: take the json path (also for a
    missing or mistyped weight_map, so its error is the json path's). With `files` (the folder's safetensors
    names), the usual index, which names only those, decodes each value as one of them, shared: 200k values
    are then a few dozen strs, which the checks against the headers compare by identity. One that names any
    other file takes the json path, as one that is mistyped does."""
    try:
        return (_index_of(files) if files else _INDEX).decode(raw).weight_map
    except _FAILED:
        return None


@functools.lru_cache(maxsize=8)
def _index_of(files: tuple[str, ...]) -> msgspec.json.Decoder:
    struct = msgspec.defstruct("IndexOf", [("weight_map", dict[str, Literal[files]] | None, None)], gc=False)
    return msgspec.json.Decoder(struct)
