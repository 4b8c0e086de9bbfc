"""A small file is put together in memory (io/safetensors_write.py) in a buffer an earlier file may have used: what
it writes is its own bytes only, however the buffers are reused, and a file aborted half-written gives none back."""

from __future__ import annotations

import numpy as np
from safetensors.numpy import load_file

from kconvert.io import safetensors_write as sw


def _write(path, n: int, fill: int, finish: bool = True) -> sw.SafetensorsWriter:
    w = sw.SafetensorsWriter(path, [(f"t{i}", "U8", (n,)) for i in range(3)])
    for i in range(3 if finish else 1):
        w.write_bytes(i, [np.full(n, fill + i, np.uint8)])
    if finish:
        w.commit()
    return w


def test_a_reused_buffer_writes_only_this_files_bytes(tmp_path, monkeypatch):
    monkeypatch.setattr(sw, "_SPARES", [])
    _write(tmp_path / "big.safetensors", 30_000, 7)  # leaves its buffer, full of 7s, 8s and 9s
    assert len(sw._SPARES) == 1
    spare = sw._SPARES[0]
    small = _write(tmp_path / "small.safetensors", 25_000, 1)  # takes it (within twice its size)
    assert len(sw._SPARES) == 1 and sw._SPARES[0] is spare  # taken, and given back at its finish
    data = (tmp_path / "small.safetensors").read_bytes()
    assert len(data) == small.total  # nothing of the earlier file past this one's end
    got = load_file(tmp_path / "small.safetensors")
    assert {k: set(v.tolist()) for k, v in got.items()} == {"t0": {1}, "t1": {2}, "t2": {3}}


def test_an_aborted_file_gives_no_buffer_back(tmp_path, monkeypatch):
    monkeypatch.setattr(sw, "_SPARES", [])
    w = _write(tmp_path / "half.safetensors", 10_000, 5, finish=False)
    w.abort()
    assert sw._SPARES == [] and not (tmp_path / "half.safetensors").exists()
