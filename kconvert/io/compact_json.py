"""Compact JSON of large documents, byte for byte what `json.dumps(obj, separators=(",", ":"))` writes.

The documents that grow with the tensor count (a safetensors header, a rank's tensor list) are written for
every file of a conversion, and their bytes are part of it (a file's CRC, kconvert.json's digest). msgspec
encodes them several times faster; its bytes are used whenever they are json.dumps' text: when they are all
ASCII below DEL (msgspec writes other characters raw, json.dumps escapes them). For documents of strings,
integers, None, booleans, lists, tuples and str-keyed dicts; json.dumps writes some floats differently, so
callers pass none.
"""

from __future__ import annotations

import json

import msgspec


def compact_json(obj, *, allow_nan: bool = True) -> bytes:
    try:
        raw = msgspec.json.encode(obj)
        if raw.isascii() and b"\x7f" not in raw:
            return raw
    except (TypeError, ValueError, OverflowError, msgspec.EncodeError):  # an int past 64 bits, a lone surrogate
        pass
    return json.dumps(obj, separators=(",", ":"), allow_nan=allow_nan, default=msgspec.structs.asdict).encode()
