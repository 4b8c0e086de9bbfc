"""A file mapping's pages made present before anyone reads them, fast where they are cached and with an error, not a
crash, where the disk fails.

Reading a byte of each page (`touch`) is the fastest way to map pages the page cache holds: the kernel maps a large
folio at once (a 2 MiB one by one page-table entry), where MADV_POPULATE_READ walks the range a page at a time (1.7x
slower on Linux 6.18). But a page that must come from the disk and cannot (EIO), or lies past the end of a file that
shrank, kills a reader that touches it (SIGBUS); MADV_POPULATE_READ answers EIO / EFAULT instead. So `present` asks
mincore(2) first: a range wholly in the page cache is touched, any other populated. Both calls go through ctypes,
which lets go of the GIL: ranges are made present on several threads at once."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os

MADV_POPULATE_READ = 22  # Linux 5.14+; this Python's mmap module may not name it


def _libc(name: str, argtypes: list):
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return fn


_MADVISE = _libc("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int])
_MINCORE = _libc("mincore", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p])


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


def present(buf, lo: int, hi: int) -> None:
    """Bytes [lo, hi) of `buf` (a uint8 tensor over a mapping; lo page-aligned in it) mapped now: touched where the
    page cache holds them all, else populated (OSError for a page that cannot be read); touched on a kernel without
    MADV_POPULATE_READ."""
    address = buf.data_ptr() + lo
    if not resident(address, hi - lo):
        try:
            return populate(address, hi - lo)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
    int(buf[lo:hi:mmap.PAGESIZE].sum())  # (torch's sum runs without the GIL)
