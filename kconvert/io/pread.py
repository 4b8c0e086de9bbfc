"""Positioned reads: the one loop that reads exactly N bytes at an offset (no mmap, so RSS reflects
what we hold, and threads can share one descriptor)."""

from __future__ import annotations

import os
from pathlib import Path

from kconvert.errors import FormatError


def pread_into(fd: int, view: memoryview, offset: int, path: Path, tensor: str | None = None) -> None:
    """Fill `view` with the file's bytes from `offset` on; FormatError if the file is shorter now."""
    done, length = 0, len(view)
    while done < length:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise FormatError(f"file ended at byte {offset + done} while reading: truncated", file=str(path),
                              tensor=tensor)
        done += got


def pread_fd(fd: int, offset: int, length: int, path: Path, tensor: str | None = None) -> bytearray:
    buf = bytearray(length)
    pread_into(fd, memoryview(buf), offset, path, tensor)
    return buf


def read_bytes(path: Path, begin: int, length: int, *, tensor: str | None = None) -> bytearray:
    """Exactly `length` bytes of `path` from `begin`."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return pread_fd(fd, begin, length, path, tensor)
    finally:
        os.close(fd)
