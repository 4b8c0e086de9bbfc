"""Compressed shards (docs/FORMAT.md, "Compressed shards"): lossless zstd with per-tensor byte grouping.

A compressed shard is the plain safetensors file cut into chunks, each compressed on its own:

    [8-byte N][N bytes JSON header][chunk index: one 32-byte entry per chunk][zstd frames ...]

The JSON header is the plain file's (same tensors, same data_offsets, which stay relative to the
*plain* data region) with codec keys added to `__metadata__`, so headers, inspect and the loader's
index work without decompressing anything. The chunks cover the plain file [0, kconvert_size)
byte for byte, its own header first: decompressing every chunk in order gives back the plain file
exactly (so CRC-32s in kconvert.json mean the same for both forms, and unpack is byte-identical).
A chunk never mixes byte groupings; within a chunk of a k-byte dtype the bytes are stored as k
planes (byte 0 of every element, then byte 1, ...), so zstd sees sign/exponent bytes apart from
mantissa bytes. One tensor, or a row range, is read by decompressing only the chunks it overlaps.
"""

from __future__ import annotations

import bisect
import os
import struct
import sys
import threading
import zlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import zstandard

from kconvert import arguments
from kconvert.errors import FormatError, UsageError
from kconvert.io.pread import pread_fd, read_bytes
from kconvert.io.regular import open_regular

CODEC = "zstd"
CODEC_VERSION = "1"
DEFAULT_LEVEL = 1  # measured (bench/compress_bench.py): on grouped weights level 1 beats 3-9 in ratio and speed
CHUNK = 4 * 1024 * 1024
SAMPLE = 256 * 1024  # bytes of a tensor tried both ways when choosing its grouping
ENTRY = struct.Struct("<QQIIBBHI")  # plain offset, stored offset, plain length, stored length, group, method, 0, 0
GROUPS = (1, 2, 4, 8)
_ZERO_CRC = "00000000"
_WIDE = {2: np.uint16, 4: np.uint32, 8: np.uint64}
_local = threading.local()


def parse_codec(text: str) -> tuple[str, int]:
    """'zstd' or 'zstd:LEVEL' -> ('zstd', level)."""
    name, _, level = text.partition(":")
    if name != CODEC:
        raise UsageError(f"unknown codec {name!r}: supported is zstd[:LEVEL]")
    lvl = arguments.integer(level, "--compress zstd:LEVEL") if level else DEFAULT_LEVEL  # ASCII digits only
    if not -7 <= lvl <= 22 or lvl == 0:
        raise UsageError(f"zstd level {lvl} out of range (1..22, or -7..-1 for faster)")
    return name, lvl


def _dctx() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "dctx", None)
    if d is None:
        d = _local.dctx = zstandard.ZstdDecompressor()
    return d


def _cctx(level: int) -> zstandard.ZstdCompressor:
    cache = _local.__dict__.setdefault("cctx", {})
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True)
    return cache[level]


def group_bytes(data: np.ndarray, k: int):
    """Plain bytes of k-byte elements -> k planes (all byte 0s, all byte 1s, ...)."""
    return data if k == 1 else np.ascontiguousarray(data.reshape(-1, k).T)


def ungroup_bytes(planes: np.ndarray, k: int, out: np.ndarray) -> None:
    """Inverse of group_bytes, written into `out` (uint8, same length)."""
    if k == 1:
        out[:] = planes
        return
    p = planes.reshape(k, -1)
    if sys.byteorder != "little":
        out.reshape(-1, k)[:] = p.T
        return
    wide = out.view(_WIDE[k])  # element j's byte i is plane i: build each element from its top byte down
    np.copyto(wide, p[k - 1])
    for i in range(k - 2, -1, -1):
        np.left_shift(wide, 8, out=wide)
        np.bitwise_or(wide, p[i], out=wide)


class ChunkIndex:
    """What read_header learns from a compressed shard: plain size, plain data start, and the chunk index."""

    def __init__(self, path: Path, stored_size: int, head_end: int, header_raw: bytes, metadata: dict, obj: dict):
        self.path, self.stored_size, self.index_at = path, stored_size, head_end
        self._header_raw = header_raw
        self.first_tensor = _first_tensor(obj)
        codec, version = metadata.get("kconvert_codec"), metadata.get("kconvert_codec_version")
        if codec != CODEC or version != CODEC_VERSION:
            raise FormatError(f"unknown codec {codec!r} (version {version!r}): this kconvert reads {CODEC} version "
                              f"{CODEC_VERSION}; unpack it with the kconvert that packed it", file=str(path),
                              tensor=self.first_tensor)
        try:
            self.size = int(metadata["kconvert_size"])
            self.data_start = int(metadata["kconvert_data_start"])
            self.n_chunks = int(metadata["kconvert_chunks"])
            self.index_crc = str(metadata["kconvert_index_crc32"])
            self.level = int(metadata.get("kconvert_level", DEFAULT_LEVEL))
        except (KeyError, TypeError, ValueError):
            raise FormatError("compressed shard without kconvert_size / kconvert_data_start / kconvert_chunks / "
                              "kconvert_index_crc32 in its metadata", file=str(path)) from None
        if not 8 <= self.data_start <= self.size or self.n_chunks < 0:
            raise FormatError(f"compressed shard metadata inconsistent (data start {self.data_start}, plain size "
                              f"{self.size}, {self.n_chunks} chunks)", file=str(path))
        self.u_off: list[int] = []
        self.c_off: list[int] = []
        self.u_len: list[int] = []
        self.c_len: list[int] = []
        self.group: list[int] = []
        self._owners: list[tuple[int, str]] = []

    # ------------------------------------------------------------------ index
    def load_index(self, tensors: dict) -> None:
        """Read and check the chunk index (called by read_header once tensor entries exist, to name them)."""
        self._owners = sorted((e.begin, e.name) for e in tensors.values() if e.nbytes)
        need = self.n_chunks * ENTRY.size
        have = max(0, min(need, self.stored_size - self.index_at))
        raw = bytes(read_bytes(self.path, self.index_at, have)) if have else b""
        whole = have // ENTRY.size
        covered = 0
        for i in range(whole):
            uo, co, ul, cl, g, method, _, _ = ENTRY.unpack_from(raw, i * ENTRY.size)
            if uo != covered or g not in GROUPS or ul % g or method != 0:
                raise FormatError(f"chunk index entry {i} is invalid (offset {uo}, length {ul}, grouping {g}, "
                                  f"method {method})", file=str(self.path), tensor=self.owner(covered))
            covered += ul
            self.u_off.append(uo), self.c_off.append(co), self.u_len.append(ul)
            self.c_len.append(cl), self.group.append(g)
        if have < need:
            raise FormatError(f"chunk index truncated: {whole} of {self.n_chunks} entries present (file is "
                              f"{self.stored_size} bytes)", file=str(self.path), tensor=self.owner(covered))
        zeroed = self._header_raw.replace(f'"kconvert_index_crc32":"{self.index_crc}"'.encode(),
                                          f'"kconvert_index_crc32":"{_ZERO_CRC}"'.encode(), 1)
        if f"{zlib.crc32(raw, zlib.crc32(zeroed)):08x}" != self.index_crc:
            raise FormatError("chunk index or header damaged (index checksum mismatch)", file=str(self.path),
                              tensor=self.first_tensor)
        if covered != self.size:
            raise FormatError(f"chunk index covers {covered} bytes but the plain file has {self.size}",
                              file=str(self.path), tensor=self.owner(covered))
        data_at = self.index_at + need
        for i in range(self.n_chunks):
            if self.c_off[i] < data_at or self.c_off[i] + self.c_len[i] > self.stored_size:
                raise FormatError(f"chunk {i} (stored bytes {self.c_off[i]}..{self.c_off[i] + self.c_len[i]}) runs "
                                  f"past the end of the file ({self.stored_size} bytes): truncated",
                                  file=str(self.path), tensor=self.owner(self.u_off[i]))

    def owner(self, u: int) -> str:
        """The tensor holding plain byte `u` (the first at or after it), or '(header)'."""
        if u < self.data_start or not self._owners:
            return "(header)"
        i = max(0, bisect.bisect_right(self._owners, (u, "\uffff")) - 1)
        return self._owners[i][1]

    # ------------------------------------------------------------------ reading
    def _decode(self, i: int, fd: int, out: np.ndarray) -> None:
        tensor = self.owner(self.u_off[i])
        raw = pread_fd(fd, self.c_off[i], self.c_len[i], self.path, tensor)
        try:
            data = _dctx().decompress(raw, max_output_size=self.u_len[i])
        except zstandard.ZstdError as e:
            raise FormatError(f"chunk {i} is damaged: cannot decompress ({e})", file=str(self.path),
                              tensor=tensor) from None
        if len(data) != self.u_len[i]:
            raise FormatError(f"chunk {i} is damaged: {len(data)} bytes decompressed, {self.u_len[i]} expected",
                              file=str(self.path), tensor=tensor)
        ungroup_bytes(np.frombuffer(data, np.uint8), self.group[i], out)

    def read_into(self, out: np.ndarray, pool: ThreadPoolExecutor | None = None) -> None:
        """Decompress the whole plain file into `out` (uint8, self.size), chunks in parallel on `pool`."""
        fd, _ = open_regular(self.path, FormatError)
        try:
            def one(i: int) -> None:
                self._decode(i, fd, out[self.u_off[i]:self.u_off[i] + self.u_len[i]])
            if pool is None:
                for i in range(self.n_chunks):
                    one(i)
            else:
                list(pool.map(one, range(self.n_chunks)))
        finally:
            os.close(fd)

    def read_range(self, lo: int, n: int) -> bytearray:
        """Plain bytes [lo, lo + n), decompressing only the chunks they overlap."""
        buf = bytearray(n)
        view = np.frombuffer(buf, np.uint8) if n else np.empty(0, np.uint8)
        i = max(0, bisect.bisect_right(self.u_off, lo) - 1)
        fd, _ = open_regular(self.path, FormatError)
        try:
            while i < self.n_chunks and self.u_off[i] < lo + n:
                a, b = self.u_off[i], self.u_off[i] + self.u_len[i]
                if lo <= a and b <= lo + n:
                    self._decode(i, fd, view[a - lo:b - lo])
                else:
                    tmp = np.empty(self.u_len[i], np.uint8)
                    self._decode(i, fd, tmp)
                    s, e = max(a, lo), min(b, lo + n)
                    view[s - lo:e - lo] = tmp[s - a:e - a]
                i += 1
        finally:
            os.close(fd)
        return buf

    def iter_chunks(self, threads: int = 4):
        """Plain chunks in file order (uint8 arrays), decompressed `threads` at a time ahead of the caller."""
        fd, _ = open_regular(self.path, FormatError)

        def one(i: int) -> np.ndarray:
            out = np.empty(self.u_len[i], np.uint8)
            self._decode(i, fd, out)
            return out
        try:
            with ThreadPoolExecutor(max(1, threads)) as pool:
                ahead: deque = deque()
                for i in range(self.n_chunks):
                    ahead.append(pool.submit(one, i))
                    if len(ahead) > 2 * threads:
                        yield ahead.popleft().result()
                while ahead:
                    yield ahead.popleft().result()
        finally:
            os.close(fd)

    def crc32(self, threads: int = 4, progress=None) -> str:
        crc = 0
        for part in self.iter_chunks(threads):
            crc = zlib.crc32(part, crc)
            if progress:
                progress(len(part))
        return f"{crc:08x}"


def _first_tensor(obj: dict) -> str | None:
    try:
        return min((k for k in obj if k != "__metadata__"), key=lambda k: int(obj[k]["data_offsets"][0]))
    except (ValueError, KeyError, TypeError, IndexError):
        return None


# --------------------------------------------------------------------------- writing
