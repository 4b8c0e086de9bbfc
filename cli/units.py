"""Human-readable sizes and counts, both ways."""

from __future__ import annotations

import re

from kconvert.arguments import byte_count
from kconvert.errors import UsageError

_UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9, "T": 10**12,
          "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str, option: str = "size") -> int:
    """'8GB' -> 8e9, '512MiB' -> 512 * 2**20, '1e9' -> 1e9; at least 1 byte, at most 1 EiB (kconvert/arguments)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", text, re.ASCII)
    if not m or m.group(2).upper() not in _UNITS or len(m.group(1)) > 32:
        raise UsageError(f"cannot read {option} {text!r} (examples: 64MB, 8GB, 2GiB)")
    return byte_count(float(m.group(1)) * _UNITS[m.group(2).upper()], option, text)


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return str(n)


def fmt_count(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return f"{n:.0f}"
