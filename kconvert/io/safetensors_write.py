"""Write one safetensors file tensor by tensor, crash-safely.

The header is computed up front from the planned (name, dtype, shape) list, so tensors can be
produced and written one at a time (memory: one tensor), each at its planned offset in any order
(shard writes a batch of same-shape experts, then the next shape). Bytes go to a hidden temporary name,
are fsynced, then renamed into place (and the directory fsynced): a file under its final name is
always complete. Each tensor's bytes are written straight from the tensor's memory (no copy) and
passed over once for its CRC-32; the file's CRC-32 is combined from those in file order (io/crc.py).

Durability in batches: `finish()` ends a file without waiting for the disk (it only starts the
writeback), and `commit_all()` later fsyncs a group of finished files, renames them into place and
fsyncs their directory once, so a worker never waits for the disk and a caller can make a whole unit
durable before it journals it. `commit()` is both for one file. After the fsync the file's pages are
dropped from the page cache (they are clean then): a conversion does not push the page cache out.
Over 300 lines: the writer, its batched durability and the staged small files' reused buffers share one file's
state (offsets, CRCs, the pending renames); split, each part would reach into the others'.
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass, field
from itertools import accumulate, repeat
from operator import add, itemgetter, mul
from pathlib import Path

import numpy as np

from kconvert.io.atomic import fsync_dir, write_error
from kconvert.io.compact_json import compact_json
from kconvert.io.crc import crc32, crc32_combine
from kconvert.io import dtypes
from kconvert.io.dtypes import ITEMSIZE
from kconvert.io.typed_json import HeaderSpec


_NAME, _TAG, _SHAPE = itemgetter(0), itemgetter(1), itemgetter(2)  # of a planned (name, tag, shape)
WRITEBACK_STEP = 64 << 20  # start writing a growing file back every this many bytes
STAGE_BYTES = 4 << 20  # a file up to this size is put together in memory and written at once
PERIODS = (1, 2, 3)  # interleavings of like tensors write_stacked copies whole (gate/up of each expert: 2)


@dataclass
class WrittenFile:
    path: Path
    bytes: int
    crc32: str
    tensor_crc32: dict[str, str] = field(default_factory=dict)
    notes: dict = field(default_factory=dict)  # what its writer noted about its tensors, for the journal (exact casts)


def tensor_bytes(t: torch.Tensor):
    """A zero-copy byte view of a CPU tensor (numpy has no bf16/fp8, so view as uint8 first)."""
    import torch  # here: a job of plain copies writes bytes and never imports torch (convert/shard/byte_copy.py)

    t = t.detach().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""


_CREATE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)


class SafetensorsWriter:
    def __init__(self, path: Path, specs: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self.specs = list(specs)
        # the header built a column at a time (a release's unit plans thousands of tensors a file)
        names, tags, shapes = (list(map(f, self.specs)) for f in (_NAME, _TAG, _SHAPE))
        self._size = list(map(mul, map(math.prod, shapes), map(ITEMSIZE.__getitem__, tags)))  # bytes of each
        ends = list(accumulate(self._size))
        starts = [0, *ends[:-1]] if ends else []  # of each tensor in the data region
        offset = ends[-1] if ends else 0
        header: dict = {"__metadata__": metadata} if metadata else {}
        header.update(zip(names, map(HeaderSpec, tags, shapes, zip(starts, ends))))
        raw = compact_json(header)
        raw += b" " * (-len(raw) % 8)  # data region 8-byte aligned, as safetensors writes it
        self._head = len(raw).to_bytes(8, "little") + raw
        self.total = len(self._head) + offset
        # each tensor lands at its planned offset, in any order (shard writes same-shape batches): by index
        self._index = dict(zip(names, range(len(names))))
        self._at = list(map(add, repeat(len(self._head)), starts))
        self._crcs: list[int | None] = [None] * len(self.specs)
        self._next = 0  # tensors written
        self._tensor_crc: dict[str, str] = {}
        self.notes: dict = {}  # the caller's, journalled with the file (shard: its exact casts, quant/tally.py)
        self._lo, self._hi = self.total, 0  # the range written since writeback was last started
        # a small file is put together in memory and written once: one system call, not one per tensor
        self._stage = _staging(self.total) if self.total <= STAGE_BYTES else None
        self.tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        try:
            try:
                self._fd: int | None = os.open(self.tmp, _CREATE, 0o644)
            except FileNotFoundError:  # its folder is not there yet (made here, not asked about for every file)
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(self.tmp, _CREATE, 0o644)
        except OSError as e:
            raise write_error(e, self.path) from None
        self._finished = False
        self._write([self._head], 0)
        self._crc = crc32(self._head)  # the header's; finish() extends it by the tensors'

    def _write(self, buffers: list, at: int) -> None:
        """Put `buffers` back to back from file offset `at`: into the staged file, or one positioned write."""
        if self._stage is not None:
            for b in buffers:
                view = memoryview(b).cast("B")
                self._stage[at:at + len(view)] = view
                at += len(view)
            return
        self._pwrite([memoryview(b).cast("B") for b in buffers], at)

    def _pwrite(self, views: list[memoryview], at: int) -> None:
        n_all = sum(len(v) for v in views)
        try:
            done = 0
            while done < n_all:
                n = os.pwritev(self._fd, views, at + done)
                done += n
                while n and views:  # drop what was written (a short write resumes mid-buffer)
                    if n >= len(views[0]):
                        n -= len(views.pop(0))
                    else:
                        views[0], n = views[0][n:], 0
        except OSError as e:
            self.abort()
            raise write_error(e, self.path) from None
        self._lo, self._hi = min(self._lo, at), max(self._hi, at + n_all)
        if self._hi - self._lo >= WRITEBACK_STEP:  # a big file: keep the disk busy while it grows
            _advise(self._fd, "POSIX_FADV_DONTNEED", self._lo, self._hi - self._lo)
            self._lo, self._hi = self.total, 0

    def write(self, name: str, t: torch.Tensor, crc: int | None = None) -> int:
        """Tensor `name`'s bytes; returns their CRC-32. `crc`: theirs already (the same tensor written to another
        rank's file: a replicated weight is passed over once, not once per rank)."""
        i = self._index.get(name, -1)
        want_name, tag, shape = self.specs[i] if i >= 0 else (name, None, None)
        if i < 0 or self._crcs[i] is not None or dtypes.TAGS.get(t.dtype) != tag or tuple(t.shape) != tuple(shape):
            self.abort()
            raise RuntimeError(f"writer expected {want_name} {tag}{list(shape or ())} once, got {name} {t.dtype}{list(t.shape)}")
        return self.write_bytes(i, [tensor_bytes(t)], None if crc is None else [crc])[0]

    def index(self, name: str) -> int:
        """Where tensor `name` is in the planned order (for write_bytes)."""
        return self._index[name]

    def indices(self, names: list[str]) -> list[int]:
        """index() of each of `names` (for write_stacked)."""
        return list(map(self._index.__getitem__, names))

    def write_bytes(self, first: int, buffers: list, crcs: list[int] | None = None) -> list[int]:
        """The bytes of planned tensors first, first + 1, ... (adjacent in the file: one write), each the
        planned size: the caller has checked dtype and shape (shard's batches check them once a batch). Returns
        their CRC-32s; `crcs`: those of the same buffers, computed for another file (write's `crc`)."""
        for k, (i, data) in enumerate(enumerate(buffers, first)):
            n = memoryview(data).nbytes
            if self._crcs[i] is not None or n != self._size[i]:
                self.abort()
                raise RuntimeError(f"writer expected {self._size[i]} bytes of {self.specs[i][0]} once, got {n}")
            self._crcs[i] = crc32(data) if crcs is None else crcs[k]
        self._write(buffers, self._at[first])
        self._next += len(buffers)
        return self._crcs[first:first + len(buffers)]

    def write_stacked(self, firsts: list[int], rows: list[np.ndarray], crcs: list[list[int]] | None = None) -> list[list[int]]:
        """Many outputs alike at once (shard's stacks: a layer's experts): output n's k-th tensor is planned tensor
        firsts[n] + k and its bytes are rows[k][n] (rows[k]: uint8 [N, bytes]). Each checked as write_bytes
        checks it; into a staged file with one copy per k when the outputs lie equally spaced (the usual: the
        same tensors repeated expert after expert), else tensor by tensor. Returns each k's CRC-32s (rows[k]'s, in
        order); `crcs`: those of the same rows computed for another file (write's `crc`)."""
        n = len(firsts)
        done = []
        for k, r in enumerate(rows):
            idx = list(map(add, firsts, repeat(k)))
            if list(map(self._crcs.__getitem__, idx)).count(None) != n or \
                    set(map(self._size.__getitem__, idx)) != {r.shape[1]} or r.shape[0] != n:
                self.abort()
                raise RuntimeError(f"writer expected {n} planned tensors of {r.shape[1]} bytes once at {firsts[:3]}...")
            done.append(list(map(crc32, r)) if crcs is None else crcs[k])
            list(map(self._crcs.__setitem__, idx, done[-1]))
            if self._stage is None:
                continue
            at = np.fromiter(map(self._at.__getitem__, idx), dtype=np.int64, count=n)
            if not self._stage_strided(at, r):
                for i, row in zip(idx, r):
                    self._write([row], self._at[i])
        if self._stage is None:  # each output's tensors are adjacent: one positioned write each
            for i, first in enumerate(firsts):
                self._write([r[i] for r in rows], self._at[first])
        self._next += n * len(rows)
        return done

    def _stage_strided(self, at: np.ndarray, r: np.ndarray) -> bool:
        """rows r to staged offsets `at` with a strided copy per interleaved run, when every p-th offset is equally
        spaced (p = 1: one kind of tensor, expert after expert; 2: gate and up, alike in shape, alternating)."""
        n, width = r.shape
        for period in PERIODS:
            if n < 2 * period:
                return False
            steps = [at[q + period::period] - at[q:-period:period] for q in range(period)]
            if all(int(d[0]) >= width and bool((d == d[0]).all()) for d in steps):
                for q, d in enumerate(steps):  # (ndarray over the buffer: as_strided costs ~20 us a call)
                    np.ndarray((len(d) + 1, width), np.uint8, self._stage, int(at[q]), (int(d[0]), 1))[:] = r[q::period]
                return True
        return False

    def finish(self) -> None:
        """Every planned tensor is written: start writing the file back, do not wait for it."""
        if self._next != len(self.specs):
            self.abort()
            raise RuntimeError(f"{self.path}: {len(self.specs) - self._next} planned tensors never written")
        if self._stage is not None:
            buf, self._stage = self._stage, None
            with memoryview(buf) as whole, whole[:self.total] as staged:
                self._pwrite([staged], 0)
                self._crc = crc32(staged)  # a small file: one pass over it (simpler than combining per tensor)
            _spare(buf)
        else:
            crc = self._crc  # the file's CRC from the header's and its tensors', in file order
            for c, n in zip(self._crcs, self._size):
                crc = crc32_combine(crc, c, n)
            self._crc = crc
        self._tensor_crc = dict(zip(map(_NAME, self.specs), map("%08x".__mod__, self._crcs)))
        if self.total > STAGE_BYTES:  # (a staged file's few MB: its fsync comes with its unit's, moments later)
            _advise(self._fd, "POSIX_FADV_DONTNEED")  # on dirty pages: starts their writeback, returns at once
        self._finished = True

    def commit(self) -> WrittenFile:
        """finish() and make the file durable under its final name."""
        return commit_all([self])[0]

    def _sync(self) -> None:
        """fsync the temporary, then let the page cache drop its (now clean) pages, and close it."""
        fd, self._fd = self._fd, None
        try:
            os.fsync(fd)
            _advise(fd, "POSIX_FADV_DONTNEED")
        finally:
            os.close(fd)

    def record(self) -> WrittenFile:
        return WrittenFile(self.path, self.total, f"{self._crc:08x}", self._tensor_crc, self.notes)

    def abort(self) -> None:
        fd, self._fd = self._fd, None
        try:
            if fd is not None:
                os.close(fd)
        finally:
            self.tmp.unlink(missing_ok=True)


# Staging buffers of finished files, reused by the next ones (a unit's files are alike in size): a fresh buffer's
# pages are each faulted in and zeroed first, which at 760 staged files of a release's topology was a large part of
# opening them. A reused buffer holds an earlier file's bytes past this one's end and until this one's are written:
# a staged file is finished only when every planned byte of it was written (finish() checks), and only [0, total)
# is written out.
_SPARES: list[bytearray] = []
_SPARES_MAX = 16
_SPARES_LOCK = threading.Lock()
STAGE_ROUND = 64 << 10


def _staging(total: int) -> bytearray:
    """A buffer of at least `total` bytes (at most twice that) for a staged file; a new one is rounded up to 64 KiB,
    so that files a few header bytes larger (a later layer's names) fit it too."""
    with _SPARES_LOCK:
        for i, buf in enumerate(_SPARES):
            if total <= len(buf) <= 2 * total:
                return _SPARES.pop(i)
    return bytearray(-(-total // STAGE_ROUND) * STAGE_ROUND)



def _spare(buf: bytearray) -> None:
    with _SPARES_LOCK:
        if len(_SPARES) >= _SPARES_MAX:  # the oldest goes: the sizes a run stages change with its units
            _SPARES.pop(0)
        _SPARES.append(buf)


def commit_all(writers: list[SafetensorsWriter]) -> list[WrittenFile]:
    """Make finished files durable together: fsync each, rename each into place, fsync each directory
    once. Until this returns, none of them may be journalled; on an error every one not yet renamed
    is removed (a renamed one is complete: its bytes were fsynced before the rename)."""
    pending = list(writers)
    try:
        for w in writers:
            if not w._finished:
                w.finish()
        for w in writers:
            w._sync()
        while pending:
            os.replace(pending[0].tmp, pending[0].path)
            pending.pop(0)
        for d in dict.fromkeys(w.path.parent for w in writers):
            fsync_dir(d)
    except OSError as e:
        bad = pending[0].path if pending else writers[-1].path
        for w in pending:
            w.abort()
        raise write_error(e, bad) from None
    except BaseException:
        for w in pending:
            w.abort()
        raise
    return [w.record() for w in writers]


def _advise(fd: int, advice: str, offset: int = 0, length: int = 0) -> None:
    """posix_fadvise where the platform has it. DONTNEED on dirty pages starts their writeback (Linux)."""
    if hasattr(os, "posix_fadvise") and hasattr(os, advice):
        try:
            os.posix_fadvise(fd, offset, length, getattr(os, advice))
        except OSError:
            pass  # advice only
