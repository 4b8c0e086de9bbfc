"""CRC-32 (the one of zlib, gzip and PNG: docs/FORMAT.md) of bytes, and of a whole file from the CRC-32s of its
pieces (zlib's crc32_combine), so a writer passes over each tensor's bytes once for both its own CRC and the file's.

`crc32` is ISA-L's (the `isal` package, python-isal) where it is installed: the same checksum, computed with
carry-less multiplication at ~12 GB/s a core where zlib's table-driven loop does ~3.5 (bench/crc_cost.py); zlib's
otherwise. Either gives the same value for the same bytes (tests/io/test_crc.py). `crc32_combine`: zlib's C
function when libz can be loaded, else the same arithmetic in Python (multiplication modulo the CRC polynomial,
about 0.1 ms)."""

from __future__ import annotations

import ctypes
import ctypes.util
import zlib

_POLY = 0xEDB88320  # reflected CRC-32 polynomial


def _fastest_crc32():
    try:
        from isal.isal_zlib import crc32 as isal_crc32
    except ImportError:  # (an optional speed-up: zlib's gives the same value)
        return zlib.crc32
    return isal_crc32


crc32 = _fastest_crc32()  # crc32(data, value=0) -> int, data any C-contiguous buffer (bytes, memoryview, ndarray)


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the CRC polynomial (reflected bit order, as zlib)."""
    m, p = 1 << 31, 0
    while m:
        if a & m:
            p ^= b
            if not a & (m - 1):
                break
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


def _x2n_table() -> list[int]:
    p, table = 1 << 30, []  # x^1
    for _ in range(32):
        table.append(p)
        p = _multmodp(p, p)
    return table


_X2N = _x2n_table()


def _combine_py(crc1: int, crc2: int, len2: int) -> int:
    p, k = 1 << 31, 3  # x^0; a byte is x^8 = x^(2^3)
    while len2:
        if len2 & 1:
            p = _multmodp(_X2N[k & 31], p)
        len2 >>= 1
        k += 1
    return _multmodp(p, crc1) ^ crc2


def _load_zlib():
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("z") or "libz.so.1")
        fn = lib.crc32_combine64 if hasattr(lib, "crc32_combine64") else lib.crc32_combine
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_ulong
    fn.argtypes = [ctypes.c_ulong, ctypes.c_ulong, ctypes.c_int64 if fn.__name__.endswith("64") else ctypes.c_long]
    return fn


_ZLIB = _load_zlib()


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of A + B from crc1 = crc32(A), crc2 = crc32(B) and len2 = len(B)."""
    if len2 <= 0:
        return crc1
    if _ZLIB is not None:
        return int(_ZLIB(crc1, crc2, len2)) & 0xFFFFFFFF
    return _combine_py(crc1, crc2, len2)
