"""The entries of a safetensors header, checked: what a name's dtype, shape and offsets must be, and that the
tensors tile the data region (see safetensors_read.py for the format and why).

At 200k tensors a Python loop per entry costs more than parsing the JSON, so a header that passes every check
is checked with whole-list operations (`columns`), from typed records (`from_typed`, io/typed_json.py) or from
json.loads' dicts (`from_json`); anything unusual is walked entry by entry (`entries`, `check_tiling`), which
names the first tensor that is wrong.
"""

from __future__ import annotations

import math
from itertools import chain, repeat
from operator import add, attrgetter, itemgetter, sub
from pathlib import Path
from typing import NamedTuple

from kconvert.errors import FormatError
from kconvert.io.dtypes import ITEMSIZE


class TensorEntry(NamedTuple):
    """Where one stored tensor lives. `begin`/`end` are absolute file offsets. Immutable; a named tuple, not
    a frozen dataclass, because a released checkpoint makes 200k of them and a frozen dataclass is built
    five times slower."""

    name: str
    file: Path
    dtype: str  # safetensors tag, e.g. "BF16"
    shape: tuple[int, ...]
    begin: int
    end: int
    compressed: object = None  # ChunkIndex of a compressed shard

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def torch_dtype(self):
        from kconvert.io.dtypes import DTYPES

        return DTYPES[self.dtype]


_DTYPE, _SHAPE, _OFFSETS = itemgetter("dtype"), itemgetter("shape"), itemgetter("data_offsets")
_FIRST, _SECOND = itemgetter(0), itemgetter(1)
_TAGS = {tag: tag for tag in ITEMSIZE}  # one str per tag, not one per tensor
_FIELDS = attrgetter("dtype"), attrgetter("shape"), attrgetter("data_offsets")


def from_typed(path: Path, specs: dict, data_start: int, data_len: int) -> dict[str, TensorEntry] | None:
    """`columns` over io/typed_json's records (types already checked in C: only a missing field is left)."""
    vals = specs.values()
    dtypes, shapes, offsets = (list(map(f, vals)) for f in _FIELDS)
    if not specs or None in shapes or None in offsets:
        return None
    return columns(path, specs, dtypes, shapes, list(map(_FIRST, offsets)), list(map(_SECOND, offsets)), data_start,
                   data_len, None)  # dtypes: already ITEMSIZE's own tags (typed_json decodes them so)


def from_json(path: Path, obj: dict, data_start: int, data_len: int, comp) -> dict[str, TensorEntry] | None:
    """`columns` over json.loads' dicts, after checking every number is an int: 2.0 and True compare and hash
    equal to 2 and 1."""
    specs = obj.values()
    try:
        dtypes = list(map(_TAGS.get, map(_DTYPE, specs)))  # None: not a tag
        shape_lists = list(map(_SHAPE, specs))
        offsets = list(map(_OFFSETS, specs))
        if not specs or set(map(type, shape_lists)) != {list} or set(map(len, offsets)) != {2} \
                or not set(map(type, chain.from_iterable(shape_lists))) <= {int}:
            return None
        los, his = list(map(_FIRST, offsets)), list(map(_SECOND, offsets))
        if set(map(type, los)) | set(map(type, his)) != {int}:
            return None
        return columns(path, obj, dtypes, list(map(tuple, shape_lists)), los, his, data_start, data_len, comp)
    except (KeyError, TypeError):  # a spec that is no object or lacks a field; a dtype that is a list
        return None


def columns(path: Path, obj: dict, dtypes: list, shapes: list, los: list, his: list, data_start: int,
            data_len: int, comp) -> dict[str, TensorEntry] | None:
    """`entries` and `check_tiling` as whole-list operations over a header's columns (ints already checked), or
    None and nothing changed. Sizes are checked once per distinct (dtype, shape, size) triple; entries share one
    tuple per distinct shape and one str per dtype tag (~25 MB less at 200k tensors). On success `obj`'s values
    are replaced by the entries in place: keys hashed once, header order kept."""
    shared: dict[tuple, tuple] = {}
    shapes = list(map(shared.setdefault, shapes, shapes))  # each shape tuple hashed once (tuples cache no hash)
    by_id = {id(s): s for s in shared.values()}
    try:
        for dtype, sid, n in set(zip(dtypes, map(id, shapes), map(sub, his, los))):  # a few dozen
            shape = by_id[sid]
            if dtype is None or min(shape, default=0) < 0 or n != math.prod(shape) * ITEMSIZE[dtype]:
                return None
    except TypeError:  # a dtype that is a list: unhashable
        return None
    # Sizes are >= 0, so offsets that chain from 0 to data_len in order also lie in [0, data_len].
    begins = list(map(add, repeat(data_start), los))
    if los[0] == 0 and his[-1] == data_len and los[1:] == his[:-1]:  # in data order (writers store it so)
        ends = begins[1:]
        ends.append(data_start + data_len)
    else:
        spans = sorted(zip(los, his))  # check_tiling's order
        if spans[0][0] != 0 or spans[-1][1] != data_len or \
                list(map(_FIRST, spans[1:])) != list(map(_SECOND, spans[:-1])):
            return None
        ends = list(map(add, repeat(data_start), his))
    names = list(obj)
    obj.update(zip(names, map(tuple.__new__, repeat(TensorEntry),
                              zip(names, repeat(path), dtypes, shapes, begins, ends, repeat(comp)))))
    return obj


def entries(path: Path, obj: dict, data_start: int, data_len: int, comp) -> dict[str, TensorEntry]:
    """Every entry, checked. Released checkpoints repeat a few (dtype, shape) pairs across 100k+ tensors, so
    the shape check and byte count are done once per distinct pair; anything unusual takes `entry`, which
    checks it field by field and names what is wrong."""
    tensors: dict[str, TensorEntry] = {}
    nbytes_of: dict[tuple, int] = {}  # (dtype, shape) -> bytes, for pairs already checked
    for name, spec in obj.items():
        try:
            dtype, shape, (lo, hi) = spec["dtype"], tuple(spec["shape"]), spec["data_offsets"]
            expect = nbytes_of.get((dtype, shape))
        except (KeyError, TypeError, ValueError):
            expect = None
        if expect is None or type(lo) is not int or type(hi) is not int or not 0 <= lo <= hi <= data_len \
                or hi - lo != expect or type(spec["shape"]) is not list or not all(type(s) is int for s in shape):
            e = tensors[name] = entry(path, name, spec, data_start, data_len, comp)
            nbytes_of[(e.dtype, e.shape)] = e.nbytes
            continue
        tensors[name] = TensorEntry(name, path, dtype, shape, data_start + lo, data_start + hi, comp)
    return tensors


def check_tiling(path: Path, tensors: dict[str, TensorEntry], data_start: int, data_len: int) -> None:
    """Sorted by offset, the tensors must cover [0, data_len) exactly once (what safetensors enforces)."""
    pos, prev = data_start, None
    for e in sorted(tensors.values(), key=lambda e: (e.begin, e.end)):
        if e.begin < pos:
            raise FormatError(f"data offsets [{e.begin - data_start}, {e.end - data_start}] overlap tensor {prev} "
                              "(aliased or overlapping data)", file=str(path), tensor=e.name)
        if e.begin > pos:
            raise FormatError(f"data offsets [{e.begin - data_start}, {e.end - data_start}] leave a gap of "
                              f"{e.begin - pos} bytes after {prev or 'the header'}", file=str(path), tensor=e.name)
        pos, prev = e.end, e.name
    if pos != data_start + data_len:
        raise FormatError(f"{data_start + data_len - pos} bytes after the last tensor belong to none "
                          "(the header does not describe the whole file)", file=str(path))


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def entry(path: Path, name: str, spec, data_start: int, data_len: int, comp=None) -> TensorEntry:
    try:
        dtype, shape, (lo, hi) = spec["dtype"], spec["shape"], spec["data_offsets"]
    except (KeyError, TypeError, ValueError):
        raise FormatError("malformed header entry (needs dtype, shape, data_offsets)", file=str(path), tensor=name) from None
    if not (isinstance(shape, list) and all(map(_is_int, shape)) and _is_int(lo) and _is_int(hi)):
        raise FormatError("malformed header entry (shape and data_offsets must be lists of integers)", file=str(path),
                          tensor=name)
    shape = tuple(shape)
    if not isinstance(dtype, str) or dtype not in ITEMSIZE:
        raise FormatError(f"unsupported dtype {dtype!r}", file=str(path), tensor=name)
    if any(s < 0 for s in shape) or lo < 0 or hi < lo:
        raise FormatError(f"invalid shape {list(shape)} or offsets [{lo}, {hi}]", file=str(path), tensor=name)
    if hi > data_len:
        raise FormatError(f"data offsets [{lo}, {hi}] run past the end of the file (data region {data_len} bytes): "
                          "truncated file", file=str(path), tensor=name)
    expect = math.prod(shape) * ITEMSIZE[dtype]
    if hi - lo != expect:
        raise FormatError(f"holds {hi - lo} bytes but {dtype}{list(shape)} needs {expect}", file=str(path), tensor=name)
    return TensorEntry(name, path, dtype, shape, data_start + lo, data_start + hi, comp)
