"""A job whose every output is a plain copy (`shard --quant none` of a BF16 / FP16 / FP32 source: reshard only)
written as bytes, with numpy and os alone: torch is never imported (its ~1.5 s import was a third of a 3 GB reshard),
no tensor is made. Each source tensor is mapped from the page cache (io/pread.map_range) or read when small, checked
for NaN/Inf with two max-reductions over its integer view (no temporary), and each rank's slice goes to its file
from the mapping: a row slice or a whole tensor as it lies (zero-copy), a slice along a later dimension gathered
once. The bytes, the CRC-32s and the refusals are those of the tensor path (convert/shard/unit.py): the same slices
of the same bytes, the same NonFiniteError naming the file and tensor. Tensors whose entries are tables with a bound
(values_below), remote or compressed sources, any cast or quantized output: the tensor path takes the job."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from kconvert.convert.shard.outputs import Output, WorkItem
from kconvert.errors import KConvertError, NonFiniteError
from kconvert.io.dtypes import ITEMSIZE
from kconvert.io.safetensors_read import read_entry_bytes
from kconvert.io.safetensors_write import SafetensorsWriter
from kconvert.source.checkpoint import Checkpoint

# float tags -> (signed, unsigned) integer views and the smallest non-finite bit pattern of each sign: a value is NaN
# or +-Inf exactly when its exponent bits are all ones, i.e. as a signed integer it is >= the positive pattern
# (+Inf, positive NaNs) or as an unsigned one >= the negative pattern (-Inf, negative NaNs). FP8 e4m3fn has no Inf
# (its NaN: S.1111.111), e8m0 one NaN (0xFF): the same test with their patterns. Integer tags are always finite.
_NONFINITE = {
    "F64": (np.int64, np.uint64, 0x7FF0000000000000, 0xFFF0000000000000),
    "F32": (np.int32, np.uint32, 0x7F800000, 0xFF800000),
    "F16": (np.int16, np.uint16, 0x7C00, 0xFC00),
    "BF16": (np.int16, np.uint16, 0x7F80, 0xFF80),
    "F8_E4M3": (np.int8, np.uint8, 0x7F, 0xFF),
    "F8_E5M2": (np.int8, np.uint8, 0x7C, 0xFC),
    "F8_E8M0": (np.int8, np.uint8, None, 0xFF),
}
_CHUNK = 16 << 20  # bytes a reduction takes at once (no temporaries: only Python's loop over them)


def plain_copies(ck: Checkpoint, items: list[WorkItem]) -> bool:
    """Whether every output of the job is a plain tensor copied as stored (sliced or whole), from an uncompressed
    local source, with no bound on its values: then byte_copy writes the job."""
    if ck.remote:
        return False
    for w in items:
        for o in w.outputs:
            if o.transform != "copy" or o.copy is not None or o.info.rule.values_below is not None:
                return False
            t = ck.logical[o.src]
            if t.format != "plain" or t.stored.compressed is not None or t.stored.dtype not in ITEMSIZE:
                return False
    return True


def write_unit_bytes(ck: Checkpoint, batch: list[WorkItem], out: Path, progress) -> list[SafetensorsWriter]:
    """unit.write_unit for a job of plain copies: every rank's file of the unit in one pass over its source tensors,
    in the same (name) order, finished but not yet durable (the caller commits them: safetensors_write.commit_all)."""
    from kconvert.convert.shard.unit import _abort, _finish, _open

    writers, by_src = _open(batch, out)
    try:
        for src in sorted(by_src):
            pairs = by_src[src]
            entry = ck.logical[src].stored
            try:
                data = np.frombuffer(read_entry_bytes(entry), np.uint8) if entry.nbytes else np.empty(0, np.uint8)
                require_finite_bytes(data, entry)
                crc = None  # a whole tensor's CRC-32, once for every rank that stores it whole
                for writer, o in pairs:
                    _check_planned(writer, o, entry)
                    if o.piece.dim is None:
                        crc = writer.write_bytes(writer.index(o.src), [data], None if crc is None else [crc])[0]
                    else:
                        writer.write_bytes(writer.index(o.src), [_slice(data, entry, o)])
                    if progress:
                        progress("working", n=o.bytes_in)
            except KConvertError as e:
                e.file = e.file or str(entry.file)
                raise
            del data
        return _finish(writers)
    except BaseException:
        _abort(writers)
        raise


def require_finite_bytes(data: np.ndarray, entry) -> None:
    """NonFiniteError naming the file and tensor where a float tensor's bytes hold a NaN or an Inf (the words of
    source/formats.require_finite)."""
    how = _NONFINITE.get(entry.dtype)
    if how is None or not data.size:
        return
    signed, unsigned, positive, negative = how
    bad = 0
    for lo in range(0, data.size, _CHUNK):
        part = data[lo:lo + _CHUNK]
        if (positive is not None and int(part.view(signed).max()) >= positive) or \
                int(part.view(unsigned).max()) >= negative:
            bad = _count_nonfinite(data.view(unsigned), positive, negative)
            break
    if bad:
        raise NonFiniteError(f"{bad} NaN/Inf values in the source tensor: the checkpoint is damaged",
                             file=str(entry.file), tensor=entry.name)


def _count_nonfinite(u: np.ndarray, positive: int | None, negative: int) -> int:
    """Values whose exponent bits are all ones (as the test above finds them), counted for the message."""
    pattern = np.array(negative if positive is None else positive, u.dtype)  # every exponent bit (FP8: the NaN's)
    return sum(int(np.count_nonzero((u[lo:lo + _CHUNK] & pattern) == pattern)) for lo in range(0, u.size, _CHUNK))


def _check_planned(writer: SafetensorsWriter, o: Output, entry) -> None:
    """The file planned this output as one tensor of the source's dtype, of the slice's shape (what the tensor path's
    writer.write checks from the tensor itself)."""
    (name, tag, shape), = o.specs()
    if tag != entry.dtype or tuple(shape) != tuple(o.shape):
        raise RuntimeError(f"{writer.path}: {name} is planned as {tag}{list(shape)}, not a copy of {entry.dtype}"
                           f"{list(o.shape)}")


def _slice(data: np.ndarray, entry, o: Output) -> np.ndarray:
    """The piece's bytes, as torch's narrow(dim, start, length).contiguous() of the tensor lays them out: a view
    where they lie together (dim 0, or every dim before `dim` of size 1), else one gather."""
    p, shape = o.piece, entry.shape
    inner = math.prod(shape[p.dim + 1:]) * ITEMSIZE[entry.dtype]
    cube = data.reshape(math.prod(shape[:p.dim]), shape[p.dim], inner)
    return np.ascontiguousarray(cube[:, p.start:p.stop, :]).reshape(-1)
