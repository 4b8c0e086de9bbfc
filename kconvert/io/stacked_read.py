"""Read many small stored tensors of one dtype and shape into one stacked tensor [N, *shape].

Tensors that lie close together in a file (a layer's experts usually do) are read with one positioned
read per run of them, not one open + read + close each; when a run's tensors are equally spaced (the
usual layout: the same parts repeated expert after expert) they are copied out with one strided copy.
Plain (uncompressed) files only: the caller reads anything else one tensor at a time.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from kconvert.io.pread import pread_fd
from kconvert.io.safetensors_read import TensorEntry

GAP = 256 << 10  # bytes of other tensors a run may read past, rather than start another read
RUN_BYTES = 16 << 20  # the most one read takes


def read_stacked(entries: list[TensorEntry]) -> torch.Tensor:
    """entries (same dtype and shape, uncompressed files) -> [N, *shape] in their order. FormatError on a
    file shorter than its header says (as read_tensor)."""
    first = entries[0]
    size = first.nbytes
    out = np.empty((len(entries), size), dtype=np.uint8)
    by_file: dict = {}
    for i, e in enumerate(entries):
        by_file.setdefault(e.file, []).append((e.begin, i))
    for path, places in by_file.items():
        places.sort()
        fd = os.open(path, os.O_RDONLY)
        try:
            start = 0
            while start < len(places):
                stop = start + 1  # the run: places[start:stop]
                while (stop < len(places) and places[stop][0] - places[stop - 1][0] - size <= GAP
                       and places[stop][0] + size - places[start][0] <= RUN_BYTES):
                    stop += 1
                _copy_run(fd, path, places[start:stop], size, out, first.name)
                start = stop
        finally:
            os.close(fd)
    return torch.from_numpy(out).view(first.torch_dtype).reshape(len(entries), *first.shape)


def _copy_run(fd: int, path, run: list[tuple[int, int]], size: int, out: np.ndarray, name: str) -> None:
    base = run[0][0]
    buf = np.frombuffer(pread_fd(fd, base, run[-1][0] + size - base, path, name), dtype=np.uint8)
    begins = np.fromiter((b for b, _ in run), dtype=np.int64, count=len(run)) - base
    rows = np.fromiter((i for _, i in run), dtype=np.int64, count=len(run))
    step = int(begins[1] - begins[0]) if len(run) > 1 else size
    if step > 0 and bool((np.diff(begins) == step).all()):  # equally spaced: one strided copy
        out[rows] = np.lib.stride_tricks.as_strided(buf, (len(run), size), (step, 1), writeable=False)
        return
    for b, i in run:
        out[i] = buf[b - base:b - base + size]
