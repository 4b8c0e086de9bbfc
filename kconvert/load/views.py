"""A converted unit file's tensors as views of the buffer it was read into (kconvert/load/loader.py): no copy, except
a tensor whose offset is not a multiple of its element size (possible after an odd-sized tensor), copied to stay
aligned."""

from __future__ import annotations

from itertools import groupby
from operator import attrgetter, sub

import torch

from kconvert.io.dtypes import DTYPES, ITEMSIZE
from kconvert.io.safetensors_read import SafetensorsHeader


def tensor_views(header: SafetensorsHeader, buf: torch.Tensor) -> dict[str, torch.Tensor]:
    """Tensors as views of the file buffer (no copy); a tensor whose offset is not a multiple
    of its element size (possible after an odd-sized tensor) is copied to stay aligned. Tensors of one dtype
    and shape at evenly spaced offsets (a layer's experts, each role) are made by one strided view split in C
    (tensor.unbind): at Kimi K3's topology a rank holds 65k tensors, and three torch calls each were most of
    loading it."""
    out = dict.fromkeys(header.tensors)  # header order, whichever way each view is made
    groups: dict[tuple, list] = {}
    for e in header.tensors.values():
        groups.setdefault((e.dtype, e.shape), []).append(e)
    base, n = buf.storage_offset(), buf.numel()
    wholes: dict[str, torch.Tensor] = {}  # dtype tag -> the buffer viewed as that dtype (where aligned)
    for (tag, shape), es in groups.items():
        size = ITEMSIZE[tag]
        if es[0].nbytes and not base % size and tag not in wholes:
            wholes[tag] = buf[:n - n % size].view(DTYPES[tag])
        whole = wholes.get(tag) if es[0].nbytes else None
        strides = _contiguous_strides(shape)
        for start, stop, step in _even_runs(es) if whole is not None and len(es) >= _STRIDED_AT_LEAST \
                else ((0, len(es), 0),):
            first = (base + es[start].begin) // size
            if step and not step % size and not (base + es[start].begin) % size:
                views = whole.as_strided((stop - start, *shape), (step // size, *strides), first).unbind(0)
                out.update(zip(map(_NAME, es[start:stop]), views))
                continue
            for e in es[start:stop]:  # one call a tensor: an aligned one is a strided view of its dtype's buffer
                at = base + e.begin
                out[e.name] = whole.as_strided(shape, strides, at // size) if whole is not None and not at % size \
                    else _view(buf, e)
    return out


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= max(dim, 1)
    return tuple(reversed(strides))


_BEGIN, _NAME = attrgetter("begin"), attrgetter("name")
_STRIDED_AT_LEAST = 8  # tensors of one dtype and shape, evenly spaced, made as one strided view


def _even_runs(es: list) -> list[tuple[int, int, int]]:
    """`es` (one dtype and shape, in offset order) cut into [start, stop) runs: at least _STRIDED_AT_LEAST tensors at
    evenly spaced offsets (`step` bytes apart), and what lies between them (step 0: one view each)."""
    begins = list(map(_BEGIN, es))
    runs, taken, d = [], 0, 0  # tensors before `taken` are in a run; `d`: the first tensor of this stretch
    for step, stretch in groupby(map(sub, begins[1:], begins[:-1])):
        k = len(list(stretch))  # k equal gaps: tensors d .. d + k
        start, stop = max(d, taken), d + k + 1
        if step > 0 and stop - start >= _STRIDED_AT_LEAST:
            if start > taken:
                runs.append((taken, start, 0))
            runs.append((start, stop, step))
            taken = stop
        d += k
    if taken < len(es):
        runs.append((taken, len(es), 0))
    return runs


def _view(buf: torch.Tensor, e) -> torch.Tensor:
    """One tensor as a view of `buf`; copied when its offset is not a multiple of its element size."""
    dtype = DTYPES[e.dtype]
    if not e.nbytes:
        return torch.empty(0, dtype=dtype).reshape(e.shape)
    raw = buf[e.begin:e.end]
    return (raw.clone() if (buf.storage_offset() + e.begin) % ITEMSIZE[e.dtype] else raw).view(dtype).reshape(e.shape)
