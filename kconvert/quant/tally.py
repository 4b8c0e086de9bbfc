"""Counts a conversion reports about its exact casts, per thread: how many blocks a cast kept exactly and how many took
a data-derived scale (nvfp4's MXFP4 -> NVFP4 cast). A caller wraps the work for one output in `counting()` and reads
the pair it yields; a cast calls `count` (nothing is kept when no caller counts)."""

from __future__ import annotations

import threading
from contextlib import contextmanager

_LOCAL = threading.local()


@contextmanager
def counting():
    """Yields [blocks cast exactly, blocks given a data-derived scale], filled by the casts made inside the block."""
    prev = getattr(_LOCAL, "tally", None)
    _LOCAL.tally = tally = [0, 0]
    try:
        yield tally
    finally:
        _LOCAL.tally = prev


def count(exact: int, derived: int) -> None:
    tally = getattr(_LOCAL, "tally", None)
    if tally is not None:
        tally[0] += exact
        tally[1] += derived


def merged(into: dict, kind: str, tally) -> None:
    """Add one output's [exact, derived] to `into[kind]` (a file's or a run's record), when it counted anything."""
    if tally[0] or tally[1]:
        have = into.setdefault(kind, [0, 0])
        have[0] += tally[0]
        have[1] += tally[1]
