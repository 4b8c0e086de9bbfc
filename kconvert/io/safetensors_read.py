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
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from kconvert.errors import FormatError, MissingFileError
from kconvert.io import typed_json
from kconvert.io.gc_pause import paused_gc
from kconvert.io.header_entries import TensorEntry, check_tiling, entries, from_json, from_typed
from kconvert.io.pread import MAP_POPULATED_AT_LEAST, map_populated, map_range, pread_fd
from kconvert.io.regular import open_regular

MAX_HEADER = 256 * 1024 * 1024  # safetensors' own limit is 100 MB; be a little lenient


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
        fd, size = open_regular(path, FormatError)  # a FIFO or a device: one line, never a hang
    except MissingFileError:
        raise FormatError("file not found", file=str(path)) from None
    try:
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            raise FormatError("truncated safetensors file (no header length)", file=str(path))
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or 8 + n > size:
            raise FormatError(f"header length {n} runs past the file ({size} bytes): truncated or not safetensors",
                              file=str(path))
        raw = _header_bytes(fd, n, path)
    except OSError as e:
        raise FormatError(f"cannot be read ({e.strerror or e})", file=str(path)) from None
    finally:
        os.close(fd)
    data_start = 8 + n
    data_len = size - data_start
    typed = typed_json.header(raw)  # the usual header, decoded and type-checked in C
    if typed is not None:
        specs, metadata = typed
        metadata = metadata if isinstance(metadata, dict) else {}
        if "kconvert_codec" not in metadata:  # a compressed shard takes the json path (ChunkIndex reads its dicts)
            tensors = from_typed(path, specs, data_start, data_len)
            if tensors is not None:
                return SafetensorsHeader(path, size, data_start, tensors, metadata)
    raw = bytes(raw)  # the json path and a compressed shard's index read bytes
    obj = decode_header_json(raw, path)
    metadata = obj.pop("__metadata__", None) or {}
    metadata = metadata if isinstance(metadata, dict) else {}
    comp = None
    if "kconvert_codec" in metadata:  # a compressed shard: offsets are into the plain file it decompresses to
        from kconvert.io.compressed import ChunkIndex  # numpy and zstandard: only for compressed shards

        comp = ChunkIndex(path, size, data_start, raw, metadata, obj)
        data_start, data_len = comp.data_start, comp.size - comp.data_start
    tensors = from_json(path, obj, data_start, data_len, comp)
    if tensors is None:  # some check failed, or an entry is unusual: the walk names what is wrong
        tensors = entries(path, obj, data_start, data_len, comp)
        check_tiling(path, tensors, data_start, data_len)
    if comp is not None:
        comp.load_index(tensors)
    return SafetensorsHeader(path, comp.size if comp else size, data_start, tensors, metadata, comp)


def _header_bytes(fd: int, n: int, path: Path) -> bytes | memoryview:
    """The header's n bytes after its length: read, or viewed through a populated read-only mapping when large
    (io/pread.map_populated: a 200k-tensor release's headers are 2 MB each)."""
    if n >= MAP_POPULATED_AT_LEAST:
        try:
            return memoryview(map_populated(fd, 8 + n))[8:]
        except (OSError, ValueError):  # a file that cannot be mapped is read
            pass
    return bytes(pread_fd(fd, 8, n, path))


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
