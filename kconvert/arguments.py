"""The one check of what a user types: counts, sizes, floats and path names, for every command-line parser
(cli/params.py wraps these as click types; engine.chat calls them after argparse) and chat's /image.

Why it exists: Python's int() and float() accept far more than a user means (Unicode digits such as '٣',
'nan', 'inf', 5000-digit numbers that later end in ValueError or a C++ allocation failure), and a value
that parses can still be nonsense (--pp 0, --reserve-gb -1e30). Every refusal is a UsageError, one line
naming the option, exit code 2."""

from __future__ import annotations

import math
import os
import re

from kconvert.errors import UsageError

MAX_DIGITS = 18  # every count or byte size a user types fits in 10**18
MAX_BYTES = 1 << 60  # 1 EiB: more than any device or disk
NAME_MAX = 255  # bytes in one path component (Linux, macOS)
PATH_MAX = 4096  # bytes in a whole path
_DECIMAL = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


def integer(value, option: str, lo: int | None = None, hi: int | None = None) -> int:
    """A whole number written in ASCII digits (an int passes as it is), within [lo, hi]."""
    if isinstance(value, bool):
        raise UsageError(f"{option} {value!r}: not a whole number")
    if not isinstance(value, int):
        text = str(value).strip()
        digits = text[1:] if text[:1] in "+-" else text
        if not (digits.isascii() and digits.isdigit()):
            raise UsageError(f"{option} {value!r}: not a whole number (ASCII digits 0-9)")
        if len(digits) > MAX_DIGITS:
            raise UsageError(f"{option}: a {len(digits)}-digit number is out of range")
        value = int(text)
    return _within(value, option, lo, hi)


MAX_RANK = (1 << 20) - 1  # a global rank (stage x tp + tp rank): far past any cluster


def rank(value, option: str = "--rank") -> int:
    """A rank as a user types it (`--rank`, `--stage`, `--tp-rank`), the one parse every command shares: ASCII digits
    (`١` is not rank 1), 0 to MAX_RANK. Whether the conversion has that rank is its reader's check."""
    return integer(value, option, 0, MAX_RANK)


def number(value, option: str, lo: float | None = None, hi: float | None = None, *,
           lo_open: bool = False) -> float:
    """A finite decimal number (ASCII; no nan, inf or hex), within [lo, hi] (or (lo, hi] with lo_open)."""
    if isinstance(value, bool):
        raise UsageError(f"{option} {value!r}: not a number")
    if not isinstance(value, (int, float)):
        text = str(value).strip()
        if not (text.isascii() and _DECIMAL.fullmatch(text)) or len(text) > 64:
            raise UsageError(f"{option} {value!r}: not a decimal number")
        value = float(text)
    value = float(value)
    if not math.isfinite(value):
        raise UsageError(f"{option} {value!r}: must be a finite number")
    if lo_open and lo is not None and value <= lo:
        raise UsageError(f"{option} {_show(value)}: must be above {_show(lo)}")
    return _within(value, option, lo, hi)


def byte_count(value: float, option: str, text: object = None) -> int:
    """A parsed size (bytes, possibly fractional before rounding) that is finite, positive and at most 1 EiB."""
    shown = text if text is not None else value
    if not math.isfinite(value) or value > MAX_BYTES:
        raise UsageError(f"{option} {shown!r}: more than {MAX_BYTES >> 60} EiB, larger than any device or disk")
    if int(value) < 1:
        raise UsageError(f"{option} {shown!r}: must be at least 1 byte")
    return int(value)


def path_name(path, option: str) -> str:
    """A path the OS can create or open: no NUL, each name at most NAME_MAX bytes, the whole at most PATH_MAX
    (an over-long name otherwise fails deep inside a write or a decoder, after work was done)."""
    text = os.fspath(path)
    raw = text.encode("utf-8", "surrogateescape")
    if b"\0" in raw:
        raise UsageError(f"{option}: the path contains a NUL byte")
    if len(raw) > PATH_MAX:
        raise UsageError(f"{option}: a path of {len(raw)} bytes is longer than the system's {PATH_MAX}")
    for part in raw.split(b"/"):
        if len(part) > NAME_MAX:
            shown = part[:40].decode("utf-8", "replace")
            raise UsageError(f"{option}: the name {shown!r}... is {len(part)} bytes, longer than the "
                             f"{NAME_MAX} a file name may have", file=None)
    return text


def _within(value, option: str, lo, hi):
    if lo is not None and value < lo:
        raise UsageError(f"{option} {_show(value)}: must be at least {_show(lo)}")
    if hi is not None and value > hi:
        raise UsageError(f"{option} {_show(value)}: must be at most {_show(hi)}")
    return value


def _show(x) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"
