"""Streams and events of the stand-in device (kconvert/testing/standin.py), and the bookkeeping that
turns stream-ordering mistakes into recorded violations.

The default stream is the host itself: work submitted to it runs at once. A side stream runs its
work in order on its own thread, so a copy queued there completes later, as a DMA would. An op that
touches memory a queued copy has not yet written waits only if its stream was told to wait for that
copy's event; otherwise it reads the garbage a GPU would, and the mistake is recorded in STATS."""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

NAME = "standin"
_local = threading.local()


@dataclass
class Stats:
    copies_queued: int = 0            # non-blocking copies that ran on a side stream
    copy_sources: set = field(default_factory=set)   # host data_ptrs those copies read from
    pinned_allocations: int = 0
    event_waits: int = 0              # Event.synchronize / wait_event calls
    blocked_waits: list = field(default_factory=list)  # thread names of those that found it incomplete
    violations: list = field(default_factory=list)
    allocated: int = 0
    peak: int = 0


STATS = Stats()


class _Mark(threading.Event):
    """Completion of one piece of work queued on a stream (its position: seq)."""

    def __init__(self, stream: "Stream", seq: int):
        super().__init__()
        self.stream, self.seq = stream, seq


class Stream:
    """A queue of work. The default stream is the host itself: ops run at once, and `wait_event`
    only orders later ops after the event (they block when they touch memory a queued copy has
    not yet written). A side stream runs its queued work on its own thread, in order."""

    def __init__(self, device=None, priority: int = 0, *, _default: bool = False):
        self.device = torch.device(NAME, (torch.device(device).index or 0) if device is not None else 0)
        self.is_default = _default
        self.waited: dict[Stream, int] = {}  # default stream: seq of each stream it was told to wait for
        self._queue: queue.Queue | None = None
        self._seq = 0
        self._last: _Mark | None = None

    def _submit(self, fn) -> _Mark:
        self._seq += 1
        mark = _Mark(self, self._seq)
        if self.is_default:
            fn()
            mark.set()
            return mark
        if self._queue is None:
            self._queue = queue.Queue()
            threading.Thread(target=self._run, daemon=True, name=f"{NAME}-stream").start()
        self._queue.put((fn, mark))
        self._last = mark
        return mark

    def _run(self) -> None:
        while True:
            fn, mark = self._queue.get()
            try:
                fn()
            except BaseException as e:  # recorded, as a device fault would be reported later
                STATS.violations.append(f"stream work failed: {e!r}")
            mark.set()

    def synchronize(self) -> None:
        if self._last is not None:
            self._last.wait()

    def query(self) -> bool:
        return self._last is None or self._last.is_set()

    def wait_event(self, event: "Event") -> None:
        mark = event._done
        if mark is None or mark.is_set():
            return
        if self.is_default:
            self.waited[mark.stream] = max(self.waited.get(mark.stream, 0), mark.seq)
        else:
            self._submit(mark.wait)

    def wait_stream(self, other: "Stream") -> None:
        self.wait_event(other.record_event())

    def record_event(self, event: "Event | None" = None) -> "Event":
        event = event or Event()
        event.record(self)
        return event

    def __eq__(self, other):
        return self is other

    def __hash__(self):
        return id(self)


class Event:
    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self._done: _Mark | None = None
        self._time = 0.0

    def record(self, stream: Stream | None = None) -> None:
        stream = stream or current_stream()

        def mark():
            self._time = time.perf_counter()
        self._done = stream._submit(mark)

    def query(self) -> bool:
        return self._done is None or self._done.is_set()

    def synchronize(self) -> None:
        STATS.event_waits += 1
        if self._done is not None and not self._done.is_set():
            STATS.blocked_waits.append(threading.current_thread().name)
            self._done.wait()

    def wait(self, stream: Stream | None = None) -> None:
        (stream or current_stream()).wait_event(self)

    def elapsed_time(self, end: "Event") -> float:
        return (end._time - self._time) * 1000.0


_DEFAULT: dict[int, Stream] = {}
pending: dict[int, _Mark] = {}  # device storage ptr -> completion of a queued copy into it


def default_stream(device=None) -> Stream:
    index = torch.device(device).index or 0 if device is not None else 0
    return _DEFAULT.setdefault(index, Stream(torch.device(NAME, index), _default=True))


def current_stream(device=None) -> Stream:
    return getattr(_local, "stream", None) or default_stream(device)


@contextlib.contextmanager
def stream(s: Stream | None):
    before = getattr(_local, "stream", None)
    _local.stream = s
    try:
        yield s
    finally:
        _local.stream = before


def wait_pending(ptrs) -> None:
    """An op on the host's default stream that touches memory a queued copy has not yet written:
    fine (it waits) if the stream was told to wait for that copy's event, else the GPU bug of
    reading garbage, which is recorded and, as on a GPU, not waited for."""
    here = current_stream()
    for ptr in ptrs:
        mark = pending.get(ptr)
        if mark is None:
            continue
        if not mark.is_set():
            if here.is_default and here.waited.get(mark.stream, 0) >= mark.seq:
                mark.wait()
            else:
                STATS.violations.append("device memory used before the copy into it completed "
                                        "(its event was not waited for)")
                continue
        pending.pop(ptr, None)


def drain() -> None:
    """Wait for every queued copy (the device module's synchronize)."""
    for mark in list(pending.values()):
        mark.wait()
    pending.clear()
