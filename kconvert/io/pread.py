"""Reading byte ranges of a file: positioned reads (`pread_*`: exactly N bytes at an offset, into memory
we own, threads sharing one descriptor) and `map_range` for large ranges (a private mapping of the page
cache: no zero-filled buffer to fault in and no copy, which is most of the system time of reading a
checkpoint whose pages are cached; `bench/convert_bench.py`). RSS counts a mapped range only while a
tensor made from it is alive, as for a buffer we read into."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

from kconvert.errors import FormatError
from kconvert.io.regular import open_regular

MAP_AT_LEAST = 1 << 20  # below this a copy costs less than setting up and tearing down a mapping
# A read faults a fresh buffer in a page (4 KB) at a time and copies into it; a populated read-only mapping of the
# page cache costs two system calls, which a file of a few dozen pages already repays (side files, headers).
MAP_POPULATED_AT_LEAST = 256 << 10


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
    fd, _ = open_regular(path, FormatError)
    try:
        return pread_fd(fd, begin, length, path, tensor)
    finally:
        os.close(fd)


def map_range(path: Path, begin: int, length: int, *, tensor: str | None = None) -> memoryview | bytearray:
    """Bytes [begin, begin + length) of `path`, writable, mapped copy-on-write when the range is large
    (a write changes our copy, never the file); a plain read when it is small. FormatError if the
    file is shorter than the range now. The mapping lives as long as the returned view (or a tensor
    made from it) does."""
    if length < MAP_AT_LEAST:
        return read_bytes(path, begin, length, tensor=tensor)
    fd, size = open_regular(path, FormatError)
    try:
        if begin + length > size:
            raise FormatError(f"file ended at byte {size} while reading: truncated", file=str(path), tensor=tensor)
        start = begin - begin % mmap.ALLOCATIONGRANULARITY
        mapped = mmap.mmap(fd, begin + length - start, flags=mmap.MAP_PRIVATE,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=start)
    finally:
        os.close(fd)
    if hasattr(mapped, "madvise"):
        mapped.madvise(mmap.MADV_SEQUENTIAL)  # read ahead of the first touch; pages behind may go
    return memoryview(mapped)[begin - start:]


def map_populated(fd: int, length: int) -> mmap.mmap:
    """The first `length` bytes of `fd`'s file, mapped read-only with every page mapped at once (MAP_POPULATE where
    the system has it): for metadata read whole and dropped (an index, a large header), unlike map_range's data."""
    return mmap.mmap(fd, length, flags=mmap.MAP_PRIVATE | getattr(mmap, "MAP_POPULATE", 0), prot=mmap.PROT_READ)
