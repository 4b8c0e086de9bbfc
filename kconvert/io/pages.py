"""A file mapping's pages read from the disk before anyone uses them, with an error, not a crash, where the disk fails.

A page that must come from the disk and cannot (EIO), or lies past the end of a file that shrank, kills a reader that
touches it (SIGBUS); MADV_POPULATE_READ reads the range ahead and answers EIO / EFAULT instead. Pages the page cache
holds need no such care: they are mapped at their first use, as safetensors' mapped reads map them, and mapping them
ahead cost more than it saved (MADV_POPULATE_READ walks a range a page at a time, where a fault maps a large folio
at once; the consumer walks every page again anyway). So `present` asks first whether the cache holds the file
(cachestat(2): one call a file, folio by folio) or the range (mincore(2), page by page, where cachestat is missing),
and populates only what it does not. The calls go through ctypes, which lets go of the GIL: ranges are read on
several threads at once."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os

MADV_POPULATE_READ = 22  # Linux 5.14+; this Python's mmap module may not name it
SYS_CACHESTAT = 451  # Linux 6.5+, the same number on x86-64 and arm64 (the generic table)


def _libc(name: str, argtypes: list):
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return fn


_MADVISE = _libc("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int])
_MINCORE = _libc("mincore", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p])
_SYSCALL = _libc("syscall", None)


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in
                ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


def file_cached(fd: int, size: int) -> bool | None:
    """Whether every page of the file's first `size` bytes is in the page cache (cachestat(2): one call that walks the
    cache's folios, so a 2 MiB folio costs what a page does; mincore asks page by page); None where the kernel has no
    cachestat (before 6.5)."""
    if _SYSCALL is None or size <= 0:
        return None
    stat = _Cachestat()
    if _SYSCALL(ctypes.c_long(SYS_CACHESTAT), ctypes.c_long(fd), ctypes.byref(_Range(0, size)), ctypes.byref(stat),
                ctypes.c_long(0)) != 0:  # (syscall(2) reads every argument as a long)
        return None
    return stat.nr_cache >= -(-size // mmap.PAGESIZE)


def resident(address: int, length: int) -> bool:
    """Whether every page of [address, address + length) (address page-aligned) is in the page cache now."""
    if _MINCORE is None or length <= 0:
        return False
    pages = -(-length // mmap.PAGESIZE)
    vec = ctypes.create_string_buffer(pages)
    if _MINCORE(address, length, vec) != 0:
        return False
    return not vec.raw.strip(b"\x01")  # one byte a page, bit 0 set where resident (the other bits are reserved: 0)


def populate(address: int, length: int) -> None:
    """MADV_POPULATE_READ on the range: pages read from the disk where they are not cached. OSError as the kernel
    answers (EIO: a page the disk cannot give; EFAULT: past the end of the file; EINVAL: a kernel before 5.14)."""
    if _MADVISE is None:
        raise OSError(errno.EINVAL, "no madvise")
    if _MADVISE(address, length, MADV_POPULATE_READ) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def present(buf, lo: int, hi: int, cached: bool | None = None) -> None:
    """Bytes [lo, hi) of `buf` (a uint8 tensor over a mapping; lo page-aligned in it) read from the disk now where the
    page cache does not hold them all (`cached`: the whole file's answer from `file_cached`; else mincore's for the
    range), by MADV_POPULATE_READ: OSError for a page the disk cannot give or one past a shortened file's end. Where
    the cache holds them, nothing is done: their first use maps them from the cache, as any mapped reader's does
    (mapping them ahead cost more than it saved: the consumer walks every page again). A kernel without
    MADV_POPULATE_READ has each page read instead."""
    if cached if cached is not None else resident(buf.data_ptr() + lo, hi - lo):
        return
    try:
        return populate(buf.data_ptr() + lo, hi - lo)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
    int(buf[lo:hi:mmap.PAGESIZE].sum())  # (torch's sum runs without the GIL)
