"""Compress a plain safetensors file into a compressed shard, and back (format: kconvert/io/compressed.py)."""

from __future__ import annotations

import json
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kconvert.errors import ChecksumMismatch, FormatError
from kconvert.io.atomic import atomic_file
from kconvert.io.compressed import (CHUNK, CODEC, CODEC_VERSION, DEFAULT_LEVEL, ENTRY, GROUPS, SAMPLE, _ZERO_CRC, _cctx,
                                    group_bytes)
from kconvert.io.dtypes import ITEMSIZE
from kconvert.io.pread import pread_fd, read_bytes
from kconvert.io.regular import open_regular
from kconvert.io.safetensors_read import read_header
from kconvert.io.window import ordered_window


@dataclass
class Packed:
    plain_bytes: int
    crc32: str  # of the plain bytes
    stored_bytes: int
    level: int

    def record(self) -> dict:
        """What kconvert.json keeps under files[*].stored."""
        return {"codec": CODEC, "level": self.level, "bytes": self.stored_bytes}


def choose_group(sample: np.ndarray, itemsize: int, level: int) -> int:
    """Byte grouping for a tensor: its element size when that compresses a sample smaller, else 1.
    One-byte dtypes (fp8, int8) stay as stored: splitting their nibbles measured worse (bench)."""
    if itemsize == 1 or itemsize not in GROUPS:
        return 1
    if sample.size < 4096:
        return itemsize
    c = _cctx(level)
    return itemsize if len(c.compress(group_bytes(sample, itemsize))) <= len(c.compress(sample)) else 1


SMALL = 64 << 10  # a segment this short joins the chunk before it, under that chunk's grouping


def plan_chunks(segments: list[tuple[int, int, int]], chunk: int) -> list[tuple[int, int, int]]:
    """(start, end, group) segments covering the file -> (offset, length, group) chunks of at most `chunk`
    bytes; small neighbouring segments of the same grouping share a chunk, and a segment under SMALL bytes joins
    the chunk before it whatever its grouping (when its length is a whole number of that chunk's groups): an FP8
    weight's float32 scales, or a rank's thousands of small experts, are not a chunk each (at 65k tensors in a
    rank's files that was 65k compression calls and pool tasks; the few bytes lose little of their grouping)."""
    chunk -= chunk % 8
    out: list[list[int]] = []
    for start, end, g in segments:
        pos = start
        if out and end - start < SMALL and out[-1][1] + end - start <= chunk and (end - start) % out[-1][2] == 0:
            out[-1][1] += end - start
            continue
        while pos < end:
            if out and out[-1][2] == g and out[-1][1] < chunk:
                take = min(end - pos, chunk - out[-1][1])
                take -= take % g
                if take:
                    out[-1][1] += take
                    pos += take
                    continue
            take = min(end - pos, chunk)
            out.append([pos, take, g])
            pos += take
    return [tuple(c) for c in out]


def compress_file(src: Path, dst: Path, *, level: int = DEFAULT_LEVEL, threads: int = 4, chunk: int = CHUNK,
                  expect_crc32: str | None = None, progress=None) -> Packed:
    """Compress plain safetensors `src` into `dst` (may be the same path): temp + fsync + rename.
    With `expect_crc32`, a plain file with another CRC-32 is refused (ChecksumMismatch) and `dst` untouched."""

    src, dst = Path(src), Path(dst)
    header = read_header(src)
    if header.compressed is not None:
        raise FormatError("already compressed", file=str(src))
    obj = json.loads(bytes(read_bytes(src, 8, header.data_start - 8)))
    fd, _ = open_regular(src, FormatError)
    try:
        segments, pos = [(0, header.data_start, 1)], header.data_start
        for e in sorted(header.tensors.values(), key=lambda e: e.begin):
            if e.begin > pos:
                segments.append((pos, e.begin, 1))
            k = ITEMSIZE[e.dtype]
            s = min(e.nbytes, SAMPLE) // k * k
            at = e.begin + (e.nbytes // 2 - s // 2) // k * k
            sample = np.frombuffer(pread_fd(fd, at, s, src, e.name), np.uint8) if s else np.empty(0, np.uint8)
            if e.nbytes:
                segments.append((e.begin, e.end, choose_group(sample, k, level)))
            pos = max(pos, e.end)
        if header.size > pos:
            segments.append((pos, header.size, 1))
        chunks = plan_chunks(segments, chunk)

        meta = dict(obj.pop("__metadata__", None) or {})
        meta.update({"kconvert_codec": CODEC, "kconvert_codec_version": CODEC_VERSION, "kconvert_level": str(level),
                     "kconvert_size": str(header.size), "kconvert_data_start": str(header.data_start),
                     "kconvert_chunks": str(len(chunks)), "kconvert_index_crc32": _ZERO_CRC})

        def head(crc: str) -> bytes:
            meta["kconvert_index_crc32"] = crc
            raw = json.dumps({"__metadata__": meta, **obj}, separators=(",", ":")).encode()
            raw += b" " * (-len(raw) % 8)
            return len(raw).to_bytes(8, "little") + raw

        h0 = head(_ZERO_CRC)
        data_at = len(h0) + len(chunks) * ENTRY.size

        def work(c):
            data = np.frombuffer(pread_fd(fd, c[0], c[1], src, None), np.uint8)
            return data, _cctx(level).compress(group_bytes(data, c[2]))

        entries, crc, at = [], 0, data_at
        with atomic_file(dst, "-z") as f, ThreadPoolExecutor(max(1, threads)) as pool, \
                ordered_window(pool, work, chunks, 2 * threads + 1) as compressed:  # 2 per thread queued
            f.write(h0)
            f.write(bytes(len(chunks) * ENTRY.size))
            for c, (data, frame) in compressed:
                crc = zlib.crc32(data, crc)
                f.write(frame)
                entries.append(ENTRY.pack(c[0], at, c[1], len(frame), c[2], 0, 0, 0))
                at += len(frame)
                if progress:
                    progress(c[1])
            crc_s = f"{crc:08x}"
            if expect_crc32 is not None and crc_s != expect_crc32:
                raise ChecksumMismatch(f"checksum mismatch: the plain file has CRC-32 {crc_s}, kconvert.json "
                                       f"records {expect_crc32}; not compressing a damaged file", file=str(src))
            index = b"".join(entries)
            h1 = head(f"{zlib.crc32(index, zlib.crc32(h0[8:])):08x}")
            assert len(h1) == len(h0)
            f.seek(len(h0))
            f.write(index)
            f.seek(0)
            f.write(h1)
    finally:
        os.close(fd)
    return Packed(header.size, crc_s, at, level)


def decompress_file(src: Path, dst: Path, *, threads: int = 4, expect_crc32: str | None = None,
                    progress=None) -> tuple[int, str]:
    """Write the plain file of compressed shard `src` to `dst` (may be the same path), streaming:
    temp + fsync + rename. Returns (plain bytes, CRC-32). ChecksumMismatch leaves `dst` untouched."""

    src, dst = Path(src), Path(dst)
    comp = read_header(src).compressed
    if comp is None:
        raise FormatError("not a compressed shard", file=str(src))
    crc = 0
    with atomic_file(dst, "-z") as f:
        for part in comp.iter_chunks(threads):
            crc = zlib.crc32(part, crc)
            f.write(part)
            if progress:
                progress(len(part))
        crc_s = f"{crc:08x}"
        if expect_crc32 is not None and crc_s != expect_crc32:
            raise ChecksumMismatch(f"checksum mismatch: the uncompressed bytes have CRC-32 {crc_s}, kconvert.json "
                                   f"records {expect_crc32}", file=str(src))
    return comp.size, crc_s
