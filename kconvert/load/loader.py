"""Stream one rank of a converted checkpoint (docs/FORMAT.md) onto cpu / cuda / musa, layer by layer.

    conv = open_converted("out/", rank=0, world_size=2)   # or stage=S, tp_rank=R on a tp x pp conversion
    for unit, tensors in conv.stream(device="cuda:0", prefetch=2, verify=True):
        model.take_unit(unit, tensors)        # "globals", "vision", "layer-0000", ...

Each unit is one file. Background threads fetch the next `prefetch` files while the caller
consumes the current one. On CPU the tensors are views of a private mapping of the file (the page cache itself: no
copy), what the cache does not hold read from the disk by those threads. On an accelerator each file is read in
parallel chunks into pinned host memory, reused across files, and copied to one device allocation per unit on a side
stream. Compressed shards (kconvert/io/compressed.py) are decompressed chunk by chunk on the same
threads into the same buffers, so everything after the read (verify, views, device copy) is unchanged.
With `verify`, the file's CRC-32 is checked against kconvert.json before any tensor is handed out.
Quantized tensors arrive as stored (fp8 + scales, int8 + scales): dequantizing is the engine's call.

Over 300 lines: one rank's stream on every device (the CPU mapping, the pinned staging and side-stream copy,
compressed shards, integrity on first load) shares its prefetch threads and buffers; split, each path would
repeat the thread and buffer bookkeeping.
"""

from __future__ import annotations


import os
import queue
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kconvert import devices
from kconvert.disk_format.catalog import Catalog
from kconvert.disk_format.integrity import by_file, check_rows, check_size
from kconvert.load.first_load import mark_checked, needs_crc
from kconvert.disk_format.journal import check_not_mid_pack
from kconvert.disk_format.ranks import resolve_rank
from kconvert.errors import LoaderError, UsageError
from kconvert.io.crc import crc32, crc32_combine
from kconvert.io.pages import file_cached, present
from kconvert.io.pread import pread_into
from kconvert.io.regular import open_regular, regular_fd
from kconvert.load.views import tensor_views
from kconvert.io.safetensors_read import SafetensorsHeader, read_header
from kconvert.io.window import ordered_window

CHUNK = 8 * 1024 * 1024


@dataclass
class LoadStats:
    files: int = 0
    bytes: int = 0
    read_seconds: float = 0.0
    copy_seconds: float = 0.0  # accelerators: time the host waited for device copies (staging reuse, end)
    verify_seconds: float = 0.0
    per_unit: list[tuple[str, int, float]] = field(default_factory=list)  # (unit, bytes, seconds until ready)


class ConvertedCheckpoint:
    def __init__(self, root: Path, catalog: Catalog, rank: int, zero_copy: bool = True):
        self.root, self.catalog, self.rank = root, catalog, rank
        self.meta = catalog.doc  # the validated kconvert.json document
        self.zero_copy = zero_copy
        self.config: dict = catalog.config
        self.tp: int = catalog.tp
        self.pp: int = catalog.pp
        self.world_size: int = catalog.world_size
        self.stage: int = catalog.stage_of(rank)  # pipeline stage: its ranks hold only their stage's units
        self.tp_rank: int = catalog.tp_rank_of(rank)
        self.family: str = catalog.family
        self.quant: str = catalog.scheme
        self.files: dict[str, dict] = catalog.rank_files(rank)
        by_unit = {r["unit"]: f for f, r in self.files.items()}
        self.units: list[str] = [u for u in catalog.units if u in by_unit]
        self._file_of = by_unit
        self._rows = by_file(catalog, [rank])  # file -> its rows: this rank's list only (version 4: its own file)
        self._paths = {rel: catalog.path_of(root, rel) for rel in self.files}  # each checked once, on open
        self.stats = LoadStats()

    @property
    def total_bytes(self) -> int:
        return sum(r["bytes"] for r in self.files.values())

    def file_of(self, unit: str) -> Path:
        return self._paths[self._file_of[unit]]

    # ------------------------------------------------------------------ reading
    def _check_header(self, rel: str) -> SafetensorsHeader:
        path = self._paths[rel]
        rec = self.files[rel]
        check_size(path, rec, LoaderError)
        header = read_header(path)
        if (header.compressed is not None) != bool(rec.get("stored")):
            raise LoaderError("shard is " + ("compressed" if header.compressed is not None else "plain") +
                              " but kconvert.json records otherwise", file=str(path))
        check_rows(path, header, self._rows[rel], LoaderError)
        return header

    def _read_into(self, path: Path, buf: memoryview, size: int, pool: ThreadPoolExecutor) -> None:
        """Fill `buf` with the file, CHUNK-sized positioned reads spread over the pool's threads."""
        fd, _ = open_regular(path, LoaderError)
        try:
            list(pool.map(lambda lo: pread_into(fd, buf[lo:min(lo + CHUNK, size)], lo, path), range(0, size, CHUNK)))
        finally:
            os.close(fd)

    def _fetch(self, unit: str, verify: bool, pool: ThreadPoolExecutor, staging: torch.Tensor | None):
        """Read one unit's file into memory: (header, uint8 tensor of the whole file, seconds)."""
        rel = self._file_of[unit]
        path = self._paths[rel]
        header = self._check_header(rel)
        size = header.size
        t0 = time.perf_counter()
        crc = None
        if staging is None and self.zero_copy and header.compressed is None:
            buf, crc = _map_file(path, size, pool, verify)  # CPU: the page cache itself, no copy
        else:
            buf = staging[:size] if staging is not None else torch.empty(size, dtype=torch.uint8)
            if header.compressed is not None:
                header.compressed.read_into(buf.numpy(), pool)
            else:
                self._read_into(path, memoryview(buf.numpy()).cast("B"), size, pool)
        t1 = time.perf_counter()
        self.stats.read_seconds += t1 - t0
        if verify:
            crc = f"{crc if crc is not None else _crc32_parallel(buf.numpy(), pool):08x}"
            self.stats.verify_seconds += time.perf_counter() - t1
            if crc != self.files[rel]["crc32"]:
                from kconvert.disk_format.integrity import first_bad_tensor

                raise LoaderError("checksum mismatch: the shard is damaged (nothing from it was used)", file=str(path),
                                  tensor=first_bad_tensor(path, self.catalog, rel))
        return header, buf

    def load_unit(self, unit: str, device: str | torch.device = "cpu", *, verify: bool = False) -> dict[str, torch.Tensor]:
        return dict(next(iter(self.stream(device, prefetch=0, verify=verify, units=[unit])))[1])

    def stream(self, device: str | torch.device = "cpu", *, prefetch: int = 2, verify: bool | str = False,
               threads: int = 4, units: list[str] | None = None) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
        """Yield (unit, {name: tensor on device}) in load order, reading ahead `prefetch` units. verify: True
        checks every file's CRC-32; "first" only files not checked as they are now (load/first_load.py)."""
        if verify == "first":
            check = units is None and needs_crc(self)
            yield from self.stream(device, prefetch=prefetch, verify=check, threads=threads, units=units)
            if check:
                mark_checked(self)
            return
        dev = devices.resolve(device)
        order = list(units or self.units)
        for u in order:
            if u not in self._file_of:
                raise UsageError(f"rank {self.rank}{f' (stage {self.stage})' if self.pp > 1 else ''} has no unit {u!r} "
                                 f"(units: {', '.join(self.units)})", file=str(self.root))
        if dev.type == "cpu":
            yield from self._stream_cpu(order, prefetch, verify, threads)
        else:
            yield from self._stream_device(order, dev, prefetch, verify, threads)

    def _stream_cpu(self, order, prefetch, verify, threads):
        results: queue.Queue = queue.Queue(maxsize=max(1, prefetch))
        stop = threading.Event()

        def producer():  # (mapping pages is CPU work: threads past the cores only contend for the page tables)
            with ThreadPoolExecutor(max(1, min(threads, os.cpu_count() or 1))) as pool:
                for u in order:
                    if stop.is_set():
                        return
                    try:
                        item = (u, *self._fetch(u, verify, pool, None))
                    except BaseException as e:  # hand the error to the consumer, in order
                        results.put(("error", e, None))
                        return
                    results.put(item)

        t_start = time.perf_counter()
        worker = threading.Thread(target=producer, daemon=True, name="kconvert-loader")
        worker.start()
        try:
            for _ in order:
                unit, header, buf = results.get()
                if unit == "error":
                    raise header
                self.stats.files += 1
                self.stats.bytes += header.size
                self.stats.per_unit.append((unit, header.size, time.perf_counter() - t_start))
                yield unit, tensor_views(header, buf)
        finally:
            stop.set()
            while worker.is_alive():  # drain so the producer can finish
                try:
                    results.get(timeout=0.05)
                except queue.Empty:
                    pass

    def _stream_device(self, order, dev, prefetch, verify, threads):
        """Accelerators: a ring of prefetch + 1 pinned staging buffers. A reader thread fills slot
        i % slots with unit i, once the copy out of that slot (unit i - slots) has completed, so reads
        run up to `prefetch` units ahead of the consumer while unit i's copy runs on a side stream.
        The consumer's stream waits on each copy's event: the host hands unit i out without waiting."""
        mod = devices.module(dev)
        depth = max(prefetch, 0)
        biggest = max(self.files[self._file_of[u]]["bytes"] for u in order)
        staging = [devices.pinned_empty(biggest) for _ in range(min(depth + 1, len(order)))]
        copy_done: list = [None] * len(staging)  # the event of the last copy out of each slot
        side, consumer = mod.Stream(dev), mod.current_stream(dev)
        t_start = time.perf_counter()

        def fetch(i):
            slot = i % len(staging)
            if copy_done[slot] is not None:
                t0 = time.perf_counter()
                copy_done[slot].synchronize()  # blocks while unit i - slots is still being copied out
                self.stats.copy_seconds += time.perf_counter() - t0
            return self._fetch(order[i], verify, pool, staging[slot])

        with ThreadPoolExecutor(threads) as pool, \
                ThreadPoolExecutor(1, thread_name_prefix="kconvert-staging") as reader:
            try:
                # reads i .. i + depth are queued while unit i is handed out: the slot of read i + depth
                # is (i - 1) % slots, whose copy was issued last iteration. When the consumer stops early
                # the window cancels queued reads and waits for a running one before the buffers go.
                with ordered_window(reader, fetch, range(len(order)), depth + 1) as reads:
                    for i, (header, buf) in reads:
                        unit = order[i]
                        dst = torch.empty(header.size, dtype=torch.uint8, device=dev)  # on the consumer's stream
                        side.wait_stream(consumer)  # dst's memory may have been freed by work still queued there
                        with mod.stream(side):
                            dst.copy_(buf, non_blocking=True)
                            event = mod.Event()
                            event.record(side)
                        copy_done[i % len(staging)] = event
                        consumer.wait_event(event)  # later work on the consumer's stream sees the bytes
                        self.stats.files += 1
                        self.stats.bytes += header.size
                        self.stats.per_unit.append((unit, header.size, time.perf_counter() - t_start))
                        yield unit, tensor_views(header, dst)
            finally:
                t0 = time.perf_counter()
                side.synchronize()  # no copy may outlive its staging buffer
                self.stats.copy_seconds += time.perf_counter() - t0


CRC_CHUNK = 8 << 20  # a mapped file is read ahead and its CRC-32 computed in pieces of this size on the pool's
# threads (the CRC-32s then combined)


def _crc32_parallel(data, pool: ThreadPoolExecutor) -> int:
    """CRC-32 of a C-contiguous byte array, CRC_CHUNK pieces on the pool (the checksum releases the GIL), combined in
    order (io/crc.crc32_combine): a large unit file is checked at the cores' speed, not one core's."""
    starts = range(0, data.size, CRC_CHUNK)
    return _combined(list(pool.map(lambda lo: crc32(data[lo:lo + CRC_CHUNK]), starts)), data.size)


def _combined(parts: list[int], size: int) -> int:
    """The CRC-32 of a file from its CRC_CHUNK pieces' (in order)."""
    crc = parts[0] if parts else 0
    for i, part in enumerate(parts[1:], 1):
        crc = crc32_combine(crc, part, min(CRC_CHUNK, size - i * CRC_CHUNK))
    return crc


def _map_file(path: Path, size: int, pool: ThreadPoolExecutor, verify: bool) -> tuple[torch.Tensor, int | None]:
    """(A private, copy-on-write mapping of the whole file; its CRC-32 where `verify`). What the page cache does not
    hold is read from the disk now, on the reader's threads, so the consumer never waits on the disk and a disk error
    is an error rather than a crash (io/pages.present); with `verify` each piece's CRC-32 is computed right after,
    while its bytes are in the cache. A write copies just that page, privately."""
    import mmap

    with regular_fd(path, LoaderError) as (fd, _):
        mm = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        cached = file_cached(fd, size)  # one call for the file (None: mincore asks range by range)
    buf = torch.frombuffer(mm, dtype=torch.uint8)  # the tensor keeps the mapping alive
    if cached and not verify:
        return buf, None  # nothing to read ahead: the pages are mapped at first use, from the cache
    data = buf.numpy()

    def piece(lo: int) -> int | None:
        hi = min(lo + CRC_CHUNK, size)
        present(buf, lo, hi, cached)
        return crc32(data[lo:hi]) if verify else None

    try:
        parts = list(pool.map(piece, range(0, size, CRC_CHUNK)))
    except OSError as e:  # EIO: a page the disk cannot give; EFAULT: the file is shorter now
        raise LoaderError(f"cannot read the shard: {e.strerror}", file=str(path)) from None
    return buf, _combined(parts, size) if verify else None


def open_converted(path: str | Path, rank: int | None = None, world_size: int | None = None, *,
                   stage: int | None = None, tp_rank: int | None = None, zero_copy: bool = True) -> ConvertedCheckpoint:
    """Open and validate a converted directory for one rank (and, if given, the world size it will run at:
    tp x pp). The rank is global (stage * tp + tp rank; default 0), or given as `stage` and `tp_rank`; only
    that rank's files are ever opened, so a stage never reads another stage's units.

    zero_copy (CPU only): tensors are copy-on-write views of the mapped shard files, as safetensors'
    safe_open does; pass False to read into private memory when the files may change while in use."""
    root = Path(path)
    cat = Catalog.read(root)
    rank = resolve_rank(cat, root, rank, stage=stage, tp_rank=tp_rank, world_size=world_size)
    check_not_mid_pack(root)
    conv = ConvertedCheckpoint(root, cat, rank, zero_copy)
    for rel, rec in conv.files.items():  # cheap existence/size checks before anything is read
        check_size(conv._paths[rel], rec, LoaderError)
    return conv
