"""kconvert/io/crc.py: the CRC-32 every writer and reader uses is zlib's checksum (docs/FORMAT.md), whichever
implementation computes it (ISA-L's where `isal` is installed), and a file's CRC combined from its pieces is the
whole file's."""

from __future__ import annotations

import importlib
import sys
import zlib

import numpy as np
import pytest

from kconvert.io import crc as crc_mod
from kconvert.io.crc import crc32, crc32_combine


@pytest.mark.parametrize("size", [0, 1, 7, 4096, 65537, 3 << 20])
def test_crc32_is_zlibs_on_every_kind_of_buffer(size):
    data = np.random.default_rng(size).integers(0, 256, size + 13, dtype=np.uint8)
    view = data[5:5 + size]  # an unaligned start
    assert crc32(view) == zlib.crc32(view.tobytes())
    assert crc32(memoryview(view)) == zlib.crc32(view.tobytes())
    assert crc32(bytearray(view.tobytes())) == zlib.crc32(view.tobytes())
    assert crc32(view, 0x1234ABCD) == zlib.crc32(view.tobytes(), 0x1234ABCD)  # continued from an earlier piece


def test_combined_pieces_are_the_whole():
    data = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)
    whole, cut = zlib.crc32(data), 300_001
    assert crc32_combine(crc32(data[:cut]), crc32(data[cut:]), data.size - cut) == whole


def test_without_isal_zlibs_is_used(monkeypatch):
    monkeypatch.setitem(sys.modules, "isal", None)  # import isal: ImportError
    monkeypatch.setitem(sys.modules, "isal.isal_zlib", None)
    try:
        fallback = importlib.reload(crc_mod)
        assert fallback.crc32 is zlib.crc32
    finally:
        monkeypatch.undo()
        importlib.reload(crc_mod)
