"""Read many small stored tensors of one dtype and shape into one stacked tensor [N, *shape].

Tensors that lie close together in a file (a layer's experts usually do) are read with one positioned
read per run of them, not one open + read + close each; when a run's tensors are equally spaced (the
usual layout: the same parts repeated expert after expert) they are copied out with one strided copy.
Plain (uncompressed) files only: the caller reads anything else one tensor at a time.
"""

from __future__ import annotations

import os
from operator import itemgetter

import numpy as np
import torch

from kconvert.errors import FormatError
from kconvert.io.pread import pread_into, read_bytes
from kconvert.io.regular import open_regular
from kconvert.io.safetensors_read import TensorEntry

_FILE, _BEGIN = itemgetter(1), itemgetter(4)  # of a TensorEntry

GAP = 256 << 10  # bytes of other tensors a run may read past, rather than start another read
RUN_BYTES = 16 << 20  # the most one read takes


def read_stacked(entries: list[TensorEntry]) -> torch.Tensor:
    """entries (same dtype and shape, uncompressed files) -> [N, *shape] in their order. FormatError on a
    file shorter than its header says (as read_tensor). The runs are found with whole-array operations: a
    release's layer stacks hundreds of experts' parts, and a Python step per tensor was most of the read."""
    first, n = entries[0], len(entries)
    size = first.nbytes
    if n == 1:  # a weight alone: one read, none of the run-finding
        out = np.frombuffer(read_bytes(first.file, first.begin, size, tensor=first.name), np.uint8)
        return torch.from_numpy(out).view(first.torch_dtype).reshape(1, *first.shape)
    out = np.empty((n, size), dtype=np.uint8)
    begins = np.fromiter(map(_BEGIN, entries), dtype=np.int64, count=n)
    files = list(map(_FILE, entries))
    if files.count(files[0]) == n:  # the usual case: one file
        by_file = {files[0]: np.arange(n)}
    else:
        where: dict = {}
        for i, f in enumerate(files):
            where.setdefault(f, []).append(i)
        by_file = {f: np.array(rows) for f, rows in where.items()}
    for path, rows in by_file.items():
        rows = rows[np.argsort(begins[rows], kind="stable")]  # file order; equal offsets in entry order
        at = begins[rows]
        # a run ends where the next tensor lies more than GAP past this one, or would take it past RUN_BYTES
        breaks = [*(np.flatnonzero(np.diff(at) - size > GAP) + 1).tolist(), len(at)]
        fd, _ = open_regular(path, FormatError)
        try:
            start = 0
            for end in breaks:
                while start < end:
                    stop = min(end, max(start + 1, int(np.searchsorted(at, at[start] + RUN_BYTES - size, "right"))))
                    _copy_run(fd, path, at[start:stop], rows[start:stop], size, out, first.name)
                    start = stop
        finally:
            os.close(fd)
    return torch.from_numpy(out).view(first.torch_dtype).reshape(n, *first.shape)


def _copy_run(fd: int, path, at: np.ndarray, rows: np.ndarray, size: int, out: np.ndarray, name: str) -> None:
    """Tensors at file offsets `at` (ascending) into out[rows]: one read of the span, one strided copy when
    they are equally spaced (the same parts repeated expert after expert)."""
    base = int(at[0])
    buf = np.empty(int(at[-1]) + size - base, dtype=np.uint8)  # not zero-filled first, as a bytearray is
    pread_into(fd, memoryview(buf), base, path, name)
    offsets = at - base
    step = int(offsets[1]) if len(at) > 1 else size
    if step > 0 and bool((np.diff(offsets) == step).all()):  # (ndarray over the buffer: as_strided costs ~20 us)
        out[rows] = np.ndarray((len(at), size), np.uint8, buf, 0, (step, 1))
        return
    for b, i in zip(offsets.tolist(), rows.tolist()):
        out[i] = buf[b:b + size]
