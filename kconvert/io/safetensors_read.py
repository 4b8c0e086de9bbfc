"""Read safetensors files lazily and defensively: headers are parsed and checked without touching
tensor data; data is read as whole tensors or row ranges only, large ranges mapped copy-on-write
from the page cache and small ones read (io/pread.py: RSS counts only the tensors we hold).

Format: 8-byte little-endian header length N, N bytes of JSON {name: {dtype, shape, data_offsets}},
then the data region; offsets are relative to the data region.

Like the safetensors library itself (Metadata::validate + MetadataIncompleteBuffer), the tensors,
sorted by offset, must tile the data region exactly: no overlap (two names aliasing the same bytes),
no gap, nothing after the last tensor. Every file the library writes passes; a header edited to
point two tensors at one region, or to hide bytes between them, does not.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from itertools import chain, repeat
from operator import add, itemgetter, sub
from pathlib import Path
from typing import NamedTuple

from kconvert.errors import FormatError
from kconvert.io.dtypes import ITEMSIZE
from kconvert.io.gc_pause import paused_gc
from kconvert.io.pread import map_range

MAX_HEADER = 256 * 1024 * 1024  # safetensors' own limit is 100 MB; be a little lenient


class TensorEntry(NamedTuple):
    """Where one stored tensor lives. `begin`/`end` are absolute file offsets. Immutable; a named tuple, not
    a frozen dataclass, because a released checkpoint makes 200k of them and a frozen dataclass is built
    five times slower."""

    name: str
    file: Path
    dtype: str  # safetensors tag, e.g. "BF16"
    shape: tuple[int, ...]
    begin: int
    end: int
    compressed: object = None  # ChunkIndex of a compressed shard

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def torch_dtype(self) -> torch.dtype:
        from kconvert.io.dtypes import DTYPES

        return DTYPES[self.dtype]


@dataclass(frozen=True)
class SafetensorsHeader:
    path: Path
    size: int
    data_start: int
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]
    compressed: object = None  # ChunkIndex when the file is a compressed shard (kconvert/io/compressed.py)

    @property
    def stored_size(self) -> int:
        """Bytes on disk (`size` is the plain file's size, also for a compressed shard)."""
        return self.compressed.stored_size if self.compressed is not None else self.size


def read_header(path: str | os.PathLike) -> SafetensorsHeader:
    """Parse and check one file's header. Raises FormatError naming the file (and tensor)."""
    with paused_gc():
        return _read_header(Path(path))


def _read_header(path: Path) -> SafetensorsHeader:
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise FormatError("truncated safetensors file (no header length)", file=str(path))
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise FormatError(f"header length {n} runs past the file ({size} bytes): truncated or not safetensors",
                                  file=str(path))
            raw = f.read(n)
    except FileNotFoundError:
        raise FormatError("file not found", file=str(path)) from None
    except IsADirectoryError:
        raise FormatError("is a directory, not a safetensors file", file=str(path)) from None
    except PermissionError:
        raise FormatError("permission denied", file=str(path)) from None
    obj = decode_header_json(raw, path)
    data_start = 8 + n
    data_len = size - data_start
    metadata = obj.pop("__metadata__", None) or {}
    metadata = metadata if isinstance(metadata, dict) else {}
    comp = None
    if "kconvert_codec" in metadata:  # a compressed shard: offsets are into the plain file it decompresses to
        from kconvert.io.compressed import ChunkIndex  # numpy and zstandard: only for compressed shards

        comp = ChunkIndex(path, size, data_start, raw, metadata, obj)
        data_start, data_len = comp.data_start, comp.size - comp.data_start
    tensors = _bulk(path, obj, data_start, data_len, comp)
    if tensors is None:  # some check failed, or an entry is unusual: the walk names what is wrong
        tensors = _entries(path, obj, data_start, data_len, comp)
        _check_tiling(path, tensors, data_start, data_len)
    if comp is not None:
        comp.load_index(tensors)
    return SafetensorsHeader(path, comp.size if comp else size, data_start, tensors, metadata, comp)


def decode_header_json(raw: bytes, path: Path) -> dict:
    """The one place a safetensors header's JSON is decoded (any bound on what it may hold belongs here). JSON
    nested past the interpreter's recursion limit is one line; shallower nesting cannot pass `_entries`' type
    checks, so no walk of 100k+ entries for depth (io/side_files.parse_json's) is needed here."""
    try:
        obj = json.loads(raw)
    except RecursionError:
        raise FormatError("header JSON is nested too deep", file=str(path)) from None
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError, a number past Python's digit limit
        raise FormatError(f"header is not valid JSON ({e.__class__.__name__})", file=str(path)) from None
    if not isinstance(obj, dict):
        raise FormatError("header is not a JSON object", file=str(path))
    return obj


_DTYPE, _SHAPE, _OFFSETS = itemgetter("dtype"), itemgetter("shape"), itemgetter("data_offsets")
_FIRST, _SECOND = itemgetter(0), itemgetter(1)
_TAGS = {tag: tag for tag in ITEMSIZE}  # one str per tag, not one per tensor


def _bulk(path: Path, obj: dict, data_start: int, data_len: int, comp) -> dict[str, TensorEntry] | None:
    """`_entries` and `_check_tiling` for a header that passes them, as whole-list operations (C loops: at 200k
    tensors a Python loop costs more than json.loads), or None and nothing changed. Every number must be an int
    first: 2.0 and True compare and hash equal to 2 and 1, and sizes are checked once per distinct triple.
    Entries share one tuple per distinct shape and one str per dtype tag (~25 MB less at 200k tensors)."""
    specs = obj.values()
    try:
        dtypes = list(map(_TAGS.get, map(_DTYPE, specs)))  # None: not a tag
        shape_lists = list(map(_SHAPE, specs))
        offsets = list(map(_OFFSETS, specs))
        if not specs or set(map(type, shape_lists)) != {list} or set(map(len, offsets)) != {2} \
                or not set(map(type, chain.from_iterable(shape_lists))) <= {int}:
            return None
        los, his = list(map(_FIRST, offsets)), list(map(_SECOND, offsets))
        if set(map(type, los)) | set(map(type, his)) != {int}:
            return None
        shared: dict[tuple, tuple] = {}
        for dtype, shape, n in set(zip(dtypes, map(tuple, shape_lists), map(sub, his, los))):  # a few dozen
            if dtype is None or min(shape, default=0) < 0 or n != math.prod(shape) * ITEMSIZE[dtype]:
                return None
            shared[shape] = shape
        shapes = list(map(shared.__getitem__, map(tuple, shape_lists)))
    except (KeyError, TypeError):  # a spec that is no object or lacks a field; a dtype that is a list
        return None
    # Sizes are >= 0, so offsets that chain from 0 to data_len in order also lie in [0, data_len].
    begins = list(map(add, repeat(data_start), los))
    if los[0] == 0 and his[-1] == data_len and los[1:] == his[:-1]:  # in data order (writers store it so)
        ends = begins[1:]
        ends.append(data_start + data_len)
    else:
        spans = sorted(zip(los, his))  # _check_tiling's order
        if spans[0][0] != 0 or spans[-1][1] != data_len or \
                list(map(_FIRST, spans[1:])) != list(map(_SECOND, spans[:-1])):
            return None
        ends = list(map(add, repeat(data_start), his))
    names = list(obj)  # the entries replace the specs in place: keys hashed once, header order kept
    obj.update(zip(names, map(tuple.__new__, repeat(TensorEntry),
                              zip(names, repeat(path), dtypes, shapes, begins, ends, repeat(comp)))))
    return obj


def _entries(path: Path, obj: dict, data_start: int, data_len: int, comp) -> dict[str, TensorEntry]:
    """Every entry, checked. Released checkpoints repeat a few (dtype, shape) pairs across 100k+ tensors, so
    the shape check and byte count are done once per distinct pair; anything unusual takes `_entry`, which
    checks it field by field and names what is wrong."""
    tensors: dict[str, TensorEntry] = {}
    nbytes_of: dict[tuple, int] = {}  # (dtype, shape) -> bytes, for pairs already checked
    for name, spec in obj.items():
        try:
            dtype, shape, (lo, hi) = spec["dtype"], tuple(spec["shape"]), spec["data_offsets"]
            expect = nbytes_of.get((dtype, shape))
        except (KeyError, TypeError, ValueError):
            expect = None
        if expect is None or type(lo) is not int or type(hi) is not int or not 0 <= lo <= hi <= data_len \
                or hi - lo != expect or type(spec["shape"]) is not list or not all(type(s) is int for s in shape):
            e = tensors[name] = _entry(path, name, spec, data_start, data_len, comp)
            nbytes_of[(e.dtype, e.shape)] = e.nbytes
            continue
        tensors[name] = TensorEntry(name, path, dtype, shape, data_start + lo, data_start + hi, comp)
    return tensors


def _check_tiling(path: Path, tensors: dict[str, TensorEntry], data_start: int, data_len: int) -> None:
    """Sorted by offset, the tensors must cover [0, data_len) exactly once (what safetensors enforces)."""
    pos, prev = data_start, None
    for e in sorted(tensors.values(), key=lambda e: (e.begin, e.end)):
        if e.begin < pos:
            raise FormatError(f"data offsets [{e.begin - data_start}, {e.end - data_start}] overlap tensor {prev} "
                              "(aliased or overlapping data)", file=str(path), tensor=e.name)
        if e.begin > pos:
            raise FormatError(f"data offsets [{e.begin - data_start}, {e.end - data_start}] leave a gap of "
                              f"{e.begin - pos} bytes after {prev or 'the header'}", file=str(path), tensor=e.name)
        pos, prev = e.end, e.name
    if pos != data_start + data_len:
        raise FormatError(f"{data_start + data_len - pos} bytes after the last tensor belong to none "
                          "(the header does not describe the whole file)", file=str(path))


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _entry(path: Path, name: str, spec, data_start: int, data_len: int, comp=None) -> TensorEntry:
    try:
        dtype, shape, (lo, hi) = spec["dtype"], spec["shape"], spec["data_offsets"]
    except (KeyError, TypeError, ValueError):
        raise FormatError("malformed header entry (needs dtype, shape, data_offsets)", file=str(path), tensor=name) from None
    if not (isinstance(shape, list) and all(map(_is_int, shape)) and _is_int(lo) and _is_int(hi)):
        raise FormatError("malformed header entry (shape and data_offsets must be lists of integers)", file=str(path),
                          tensor=name)
    shape = tuple(shape)
    if not isinstance(dtype, str) or dtype not in ITEMSIZE:
        raise FormatError(f"unsupported dtype {dtype!r}", file=str(path), tensor=name)
    if any(s < 0 for s in shape) or lo < 0 or hi < lo:
        raise FormatError(f"invalid shape {list(shape)} or offsets [{lo}, {hi}]", file=str(path), tensor=name)
    if hi > data_len:
        raise FormatError(f"data offsets [{lo}, {hi}] run past the end of the file (data region {data_len} bytes): "
                          "truncated file", file=str(path), tensor=name)
    expect = math.prod(shape) * ITEMSIZE[dtype]
    if hi - lo != expect:
        raise FormatError(f"holds {hi - lo} bytes but {dtype}{list(shape)} needs {expect}", file=str(path), tensor=name)
    return TensorEntry(name, path, dtype, shape, data_start + lo, data_start + hi, comp)


def read_tensor(entry: TensorEntry, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """Read a stored tensor, or rows [a, b) of its first dimension (only those bytes are read)."""
    import torch  # here, not at the top: header reads (inspect, plan) never need it

    shape = list(entry.shape)
    begin, nbytes = entry.begin, entry.nbytes
    if rows is not None:
        a, b = rows
        if not shape or not (0 <= a <= b <= shape[0]):
            raise FormatError(f"row range [{a}, {b}) outside shape {shape}", file=str(entry.file), tensor=entry.name)
        row_bytes = (nbytes // shape[0]) if shape[0] else 0
        begin, nbytes, shape[0] = entry.begin + a * row_bytes, (b - a) * row_bytes, b - a
    dtype = entry.torch_dtype
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    buf = read_entry_bytes(entry, begin, nbytes)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(shape)


def read_entry_bytes(entry: TensorEntry, begin: int | None = None, nbytes: int | None = None) -> bytearray | memoryview:
    """A tensor's bytes (or plain bytes [begin, begin + nbytes) of its file), decompressing only what they
    overlap when the file is a compressed shard."""
    begin = entry.begin if begin is None else begin
    nbytes = entry.nbytes if nbytes is None else nbytes
    if entry.compressed is not None:
        return entry.compressed.read_range(begin, nbytes)
    return map_range(entry.file, begin, nbytes, tensor=entry.name)
