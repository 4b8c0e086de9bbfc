"""A job whose every output is a stored tensor copied as it is (`shard --quant none` of a BF16 / FP16 / FP32 source;
`--quant fp8` of a block-FP8 source whose other tensors are kept; `--quant fp4` of MXFP4 experts whose other tensors
are kept, Kimi K3 as released: a reshard only) written as bytes, with numpy and
os alone: torch is never imported (its ~1.5 s import was a third of a 3 GB reshard), no tensor is made. Each stored
part is mapped from the page cache (io/pread.map_range) or read when small, checked for NaN/Inf with two
max-reductions over its integer view (no temporary), block scales checked against float32's range as
source/formats.check_scale_range does, and each rank's slice goes to its file from the mapping: a row slice or a
whole tensor as it lies (zero-copy), a slice along a later dimension gathered once. The bytes, the CRC-32s and the
refusals are those of the tensor path (convert/shard/unit.py): the same slices of the same bytes, the same errors
naming the file and tensor. Tables with a bound (values_below), remote or compressed sources, a cast, a recode or a
quantized output anywhere in the job: the tensor path takes the whole job."""

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
from kconvert.source.formats import FLOAT32_MAX, largest_code, scale_range_error

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
    """Whether every output of the job is a stored tensor copied as it is, sliced or whole: a plain tensor kept, a
    block-FP8 weight and its scales resharded on block boundaries (fp8_copy) with the source's own dtypes, or an MXFP4
    weight and its scales kept whole (fp4_copy), from an uncompressed local source, with no bound on its values: then
    byte_copy writes the job."""
    if ck.remote:
        return False
    for w in items:
        for o in w.outputs:
            if o.info.rule.values_below is not None:
                return False
            t = ck.logical[o.src]
            if o.transform == "copy" and o.copy is None and t.format == "plain":
                parts = (t.stored,)
            elif _stored_copy(o, t):
                parts = (t.parts["weight"], t.parts["scale"])
            else:
                return False
            if any(e.compressed is not None or e.dtype not in ITEMSIZE for e in parts) or \
                    not _same_bytes(t, parts, [tag for _, tag, _ in o.specs()]):
                return False
    return True


# MXFP4's bytes under the tags releases store them with and the tensor path writes them with: code pairs U8
# (compressed-tensors, kconvert) or I8 (DeepSeek-V4), scales U8 or F8_E8M0: the same byte whichever tag (source/logical
# reads them as the pairs and e8m0 they are); a scale is checked as the e8m0 it is.
_FP4_TAGS = (("U8", "I8"), ("U8", "F8_E8M0"))


def _same_bytes(t, parts, spec_tags: list[str]) -> bool:
    """Whether the planned tags store `parts`' bytes unchanged: the same tags, or MXFP4's under another of its tags."""
    if t.format != "fp4_packed":
        return spec_tags == [e.dtype for e in parts]
    return len(parts) == len(spec_tags) == 2 and all(
        e.dtype in tags and tag in tags for e, tag, tags in zip(parts, spec_tags, _FP4_TAGS))


def _tags(t, parts) -> list[str]:
    """The tags `parts`' values are checked as: their own; an MXFP4 scale's bytes as e8m0."""
    return [e.dtype for e in parts] if t.format != "fp4_packed" else [parts[0].dtype, "F8_E8M0"]


_KEPT_FORMAT = {"fp8_copy": "block_fp8", "fp4_copy": "fp4_packed"}  # a lossless copy -> the stored form it keeps


def _stored_copy(o: Output, t) -> bool:
    """A weight and its scales copied in the stored form (block FP8 cut on block boundaries, MXFP4 kept whole as its
    copy requires), nothing recoded."""
    c = o.copy
    return (c is not None and c.recode is None and c.roles == ("weight", "scale")
            and _KEPT_FORMAT.get(o.transform) == t.format and (not c.whole or o.piece.dim is None)
            and len(t.parts["weight"].shape) == 2 and len(t.parts["scale"].shape) == 2)


def write_unit_bytes(ck: Checkpoint, batch: list[WorkItem], out: Path, progress) -> list[SafetensorsWriter]:
    """unit.write_unit for a job of byte copies: every rank's file of the unit in one pass over its source tensors,
    in the same (name) order, finished but not yet durable (the caller commits them: safetensors_write.commit_all)."""
    from kconvert.convert.shard.unit import _abort, _finish, _open

    writers, by_src = _open(batch, out)
    try:
        for src in sorted(by_src):
            pairs = by_src[src]
            t = ck.logical[src]
            entries = (t.stored,) if t.format == "plain" else (t.parts["weight"], t.parts["scale"])
            tags = _tags(t, entries)
            try:  # weight first: its NaN is named before the scale's
                parts = [_read_checked(e, tag) for e, tag in zip(entries, tags)]
                if len(parts) == 2:
                    _check_scale_range(t, parts[1], entries[1], tags[1])
                crcs = None  # a whole tensor's CRC-32s, once for every rank that stores it whole
                for writer, o in pairs:
                    _check_planned(o, t, entries)
                    names = [name for name, _, _ in o.specs()]
                    if o.piece.dim is None:
                        crcs = [writer.write_bytes(writer.index(name), [data], None if crcs is None else [crcs[k]])[0]
                                for k, (name, data) in enumerate(zip(names, parts))]
                    else:
                        for name, piece in zip(names, _pieces(o, entries, parts)):
                            writer.write_bytes(writer.index(name), [piece])
                    if progress:
                        progress("working", n=o.bytes_in)
            except KConvertError as e:
                e.file = e.file or str(t.main.file)
                raise
            del parts
        return _finish(writers)
    except BaseException:
        _abort(writers)
        raise


def _read_checked(entry, tag: str) -> np.ndarray:
    """A stored tensor's bytes (mapped from the page cache when large), refused if any value is NaN / Inf (as `tag`
    reads them)."""
    data = np.frombuffer(read_entry_bytes(entry), np.uint8) if entry.nbytes else np.empty(0, np.uint8)
    require_finite_bytes(data, entry, tag)
    return data


def require_finite_bytes(data: np.ndarray, entry, tag: str | None = None) -> None:
    """NonFiniteError naming the file and tensor where a float tensor's bytes (of `tag`, default its own) hold a NaN
    or an Inf (the words of source/formats.require_finite)."""
    how = _NONFINITE.get(tag or entry.dtype)
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


def _check_scale_range(t, scale: np.ndarray, entry, tag: str) -> None:
    """source/formats.check_scale_range over the scale's bytes (of `tag`): its largest magnitude times the largest
    code must stay within float32."""
    top = largest_code(t)
    if top is None or not scale.size:
        return
    if tag == "F8_E8M0":
        biggest = 2.0 ** (int(scale.max()) - 127)
    elif tag in ("F32", "F64", "F16"):
        s = scale.view({"F32": np.float32, "F64": np.float64, "F16": np.float16}[tag])
        biggest = max(float(s.max()), -float(s.min()))
    elif tag == "BF16":  # its bits are a float32's upper half
        s = (scale.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        biggest = max(float(s.max()), -float(s.min()))
    else:
        raise NotImplementedError(f"{tag} scales")  # (not planned as byte copies: plain_copies)
    if biggest * top > FLOAT32_MAX:
        raise scale_range_error(t, biggest, top)


def _check_planned(o: Output, t, entries) -> None:
    """The file planned this output as the source's parts' bytes unchanged, the weight of the slice's shape (what
    the tensor path's writer.write checks from the tensors themselves)."""
    specs = o.specs()
    shape = tuple(entries[0].shape) if t.format == "fp4_packed" else tuple(o.shape)  # (code pairs: whole tensors)
    if not _same_bytes(t, entries, [tag for _, tag, _ in specs]) or tuple(specs[0][2]) != shape:
        raise RuntimeError(f"{specs[0][0]} is planned as {specs}, not a copy of {[e.dtype for e in entries]}"
                           f"{list(o.shape)}")


def _pieces(o: Output, entries, parts: list[np.ndarray]) -> list[np.ndarray]:
    """The piece's bytes of each part, as unit._slice cuts them: the weight by the piece, its block scales by the
    blocks the piece covers."""
    p = o.piece
    if len(parts) == 1:
        return [_cut(parts[0], entries[0], p.dim, p.start, p.stop)]
    b = o.copy.block
    return [_cut(parts[0], entries[0], p.dim, p.start, p.stop),
            _cut(parts[1], entries[1], p.dim, p.start // b, -(-p.stop // b))]


def _cut(data: np.ndarray, entry, dim: int, start: int, stop: int) -> np.ndarray:
    """Elements [start, stop) along `dim` of a stored tensor's bytes, as torch's narrow(...).contiguous() lays them
    out: a view where they lie together (dim 0, or every dim before `dim` of size 1), else one gather."""
    shape = entry.shape
    inner = math.prod(shape[dim + 1:]) * ITEMSIZE[entry.dtype]
    cube = data.reshape(math.prod(shape[:dim]), shape[dim], inner)
    return np.ascontiguousarray(cube[:, start:stop, :]).reshape(-1)
