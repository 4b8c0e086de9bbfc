"""The peak RSS a run reports (shard/export/pack --json, load) is its own, not the process that started it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kconvert.host_memory import available_memory, peak_rss_bytes

HELD = 400 * 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux carries ru_maxrss over fork and exec")
def test_a_child_reports_its_own_peak_not_its_parents():
    held = bytearray(HELD)
    held[::4096] = b"\1" * len(range(0, HELD, 4096))  # resident, not just reserved
    assert peak_rss_bytes() >= HELD
    out = subprocess.run([sys.executable, "-c", "from kconvert.host_memory import peak_rss_bytes as p; "
                          "b = bytearray(32 * 2**20); b[::4096] = bytes(len(b) // 4096); print(p())"],
                         capture_output=True, text=True, check=True).stdout
    assert 32 * 2**20 <= int(out) < HELD // 2  # its 32 MB and the interpreter: far below the 400 MB held here
    del held


def test_available_memory_is_positive():
    assert 0 < available_memory()
