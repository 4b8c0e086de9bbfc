"""A CPU-backed stand-in accelerator, `standin`, registered the way torch_musa registers `musa`.

    from kconvert.load import standin
    dev = standin.install()          # torch.device("standin:0"); torch.get_device_module("standin") works
    x = torch.ones(4).to(dev)        # a real PrivateUse1 tensor: x.device.type == "standin"

What is real: the PrivateUse1 backend renamed (`torch.utils.rename_privateuse1_backend`), a device
module registered with `torch._register_device_module` (is_available, device_count, synchronize,
Stream, Event, stream(), current_stream(), memory statistics), torch.accelerator reporting it, and
tensors whose `.device` is `standin:i`, so every `dev.type != "cpu"` branch of the loader and the
engine runs. Torch 2.13 has no way to give a Python PrivateUse1 tensor storage, so each tensor is a
wrapper subclass holding a CPU tensor (`raw(t)`) and every aten op runs on that CPU tensor.

What is simulated, to catch what a GPU would punish:
- the default stream runs ops at once on the host; a `non_blocking` copy issued on a side stream is
  queued and runs later on that stream's worker thread (after `copy_delay` seconds), so reading the
  destination, or rewriting the source, before the copy's event has completed gives wrong bytes;
- a non-blocking host-to-device copy from unpinned memory, a source changed while its copy was in
  flight, and an op mixing standin and (non-scalar) cpu tensors are recorded in `STATS.violations`
  (the last also raises, as CUDA does);
- `pin_memory()` / `is_pinned()` work on CPU tensors (pinned buffers are tracked; torch 2.13 has no
  Python hook for a PrivateUse1 pinned allocator, so the two CPU kernels are registered here);
- fresh device memory is filled with 0xA5 bytes, as uninitialised memory would hold garbage.

Test support, shipped in the library so `bench/device_check.py --device standin` can dry-run the GPU
script on any machine. Installing is once per process and cannot be undone; `enable(False)` makes
the device unavailable again (torch.accelerator included) for code that asks for `auto`."""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import weakref
import zlib
from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_map

NAME = "standin"
POISON = 0xA5
aten = torch.ops.aten


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
_config = {"copy_delay": 0.0, "enabled": True}
_lock = threading.Lock()
_pinned: dict[int, int] = {}          # storage data_ptr -> bytes, for pinned host buffers
_storages: dict[int, list] = {}       # storage data_ptr -> [bytes, live wrappers]
_local = threading.local()


def reset_stats() -> None:
    global STATS
    with _lock:
        allocated = STATS.allocated
        STATS = Stats(allocated=allocated, peak=allocated)


def configure(*, copy_delay: float | None = None) -> None:
    """copy_delay: seconds each side-stream copy waits before running (widens race windows in tests)."""
    if copy_delay is not None:
        _config["copy_delay"] = copy_delay


def enable(on: bool = True) -> None:
    _config["enabled"] = on


def raw(t: torch.Tensor) -> torch.Tensor:
    """The CPU tensor behind a standin tensor (its storage is the 'device memory')."""
    return t.raw if isinstance(t, StandinTensor) else t


# ------------------------------------------------------------------ tensors


class StandinTensor(torch.Tensor):
    raw: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor, index: int = 0):
        t = torch.Tensor._make_wrapper_subclass(cls, data.shape, strides=data.stride(),
                                                storage_offset=data.storage_offset(), dtype=data.dtype,
                                                device=torch.device(NAME, index), requires_grad=False)
        t.raw = data
        _track(t, data)
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    def tolist(self):  # torch refuses it for subclasses; a device tensor copies to the host first
        return self.cpu().tolist()

    def __repr__(self):
        return f"StandinTensor({self.raw!r}, device='{self.device}')"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})


def _track(t: StandinTensor, data: torch.Tensor) -> None:
    ptr = data.untyped_storage().data_ptr()
    with _lock:
        rec = _storages.get(ptr)
        if rec is None:
            rec = _storages[ptr] = [data.untyped_storage().nbytes(), 0]
            STATS.allocated += rec[0]
            STATS.peak = max(STATS.peak, STATS.allocated)
        rec[1] += 1
    weakref.finalize(t, _untrack, ptr)


def _untrack(ptr: int) -> None:
    with _lock:
        rec = _storages.get(ptr)
        if rec is not None:
            rec[1] -= 1
            if rec[1] == 0:
                STATS.allocated -= rec[0]
                del _storages[ptr]


def _is_dev(x) -> bool:
    return isinstance(x, StandinTensor)


def _dispatch(func, args, kwargs):
    if func is aten.copy_.default:
        return _copy(*args, **kwargs)
    flat = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    flat += [x for a in (*args, *kwargs.values()) if isinstance(a, (list, tuple)) for x in a if isinstance(x, torch.Tensor)]
    index = next((a.device.index for a in flat if _is_dev(a)), 0)
    stray = [a for a in flat if not _is_dev(a) and a.dim() > 0]
    if stray and func not in (aten._to_copy.default,):
        msg = f"Expected all tensors to be on the same device, but found {NAME}:{index} and cpu ({func})"
        STATS.violations.append(msg)
        raise RuntimeError(msg)
    wrap_out = True
    if "device" in kwargs:
        wrap_out = torch.device(kwargs["device"]).type == NAME
        kwargs = {**kwargs, "device": torch.device("cpu")}
    if not func.is_view:  # views only read metadata, as on a GPU
        _wait_pending(flat)
    by_raw = {id(a.raw): a for a in flat if _is_dev(a)}
    out = func(*tree_map(raw, args), **tree_map(raw, kwargs))
    plain_view = func.is_view and torch.is_inference_mode_enabled() and not args[0].is_inference()

    def wrap(x):
        if not isinstance(x, torch.Tensor):
            return x
        if not wrap_out:  # to the host: a copy, never an alias of device memory
            return x.clone() if id(x) in by_raw else x
        if id(x) in by_raw:  # an in-place op returns the tensor it changed
            return by_raw[id(x)]
        if plain_view:  # a view of a normal tensor made under inference_mode is not an inference tensor
            with torch.inference_mode(False):
                return StandinTensor(x, index)
        return StandinTensor(x, index)

    return tree_map(wrap, out)


def _empty(size, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    data = torch.empty(size, dtype=dtype)
    data.view(-1).view(torch.uint8).fill_(POISON) if data.numel() else None
    return StandinTensor(data, torch.device(device).index or 0)


def _empty_strided(size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
    data = torch.empty_strided(size, stride, dtype=dtype)
    if data.numel():
        data.untyped_storage().fill_(POISON)  # noqa: the whole allocation is garbage
    return StandinTensor(data, torch.device(device).index or 0)


# ------------------------------------------------------------------ pinned host memory


def _pin_memory(t, device=None):
    out = torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t)
    ptr = out.untyped_storage().data_ptr()
    with _lock:
        _pinned[ptr] = out.untyped_storage().nbytes()
        STATS.pinned_allocations += 1
    weakref.finalize(out.untyped_storage(), _pinned.pop, ptr, None)
    return out


def _is_pinned(t, device=None):
    return t.untyped_storage().data_ptr() in _pinned


# ------------------------------------------------------------------ streams and events


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
_pending: dict[int, _Mark] = {}  # device storage ptr -> completion of a queued copy into it


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


def _copy(dst, src, non_blocking: bool = False):
    side = current_stream()
    if not (non_blocking and not side.is_default and _is_dev(dst)):
        _wait_pending([dst, src])
        raw(dst).copy_(raw(src))
        return dst
    host = raw(src)
    if not _is_dev(src) and not _is_pinned(host):
        STATS.violations.append("non-blocking host-to-device copy from unpinned memory")
    before = zlib.crc32(host.contiguous().view(-1).view(torch.uint8).numpy()) if host.numel() else 0
    STATS.copies_queued += 1
    STATS.copy_sources.add(host.data_ptr())
    delay = _config["copy_delay"]

    def run():
        if delay:
            time.sleep(delay)
        now = zlib.crc32(host.contiguous().view(-1).view(torch.uint8).numpy()) if host.numel() else 0
        if now != before:
            STATS.violations.append("a copy's source was overwritten while the copy was in flight")
        raw(dst).copy_(host)
    _pending[raw(dst).untyped_storage().data_ptr()] = side._submit(run)
    return dst


def _wait_pending(tensors) -> None:
    """An op on the host's default stream that touches memory a queued copy has not yet written:
    fine (it waits) if the stream was told to wait for that copy's event, else the GPU bug of
    reading garbage, which is recorded and, as on a GPU, not waited for."""
    here = current_stream()
    for t in tensors:
        if not _is_dev(t):
            continue
        ptr = t.raw.untyped_storage().data_ptr()
        mark = _pending.get(ptr)
        if mark is None:
            continue
        if not mark.is_set():
            if here.is_default and here.waited.get(mark.stream, 0) >= mark.seq:
                mark.wait()
            else:
                STATS.violations.append("device memory used before the copy into it completed "
                                        "(its event was not waited for)")
                continue
        _pending.pop(ptr, None)


def in_flight(t: torch.Tensor) -> bool:
    """Whether a queued copy into t's device memory has not run yet."""
    mark = _pending.get(raw(t).untyped_storage().data_ptr())
    return mark is not None and not mark.is_set()


# ------------------------------------------------------------------ the device module


class DeviceModule:
    """What `torch.get_device_module("standin")` returns: the part of torch.cuda's surface that
    generic device code (kconvert.load.devices, torch.accelerator) calls."""

    Stream = Stream
    Event = Event
    stream = staticmethod(stream)
    current_stream = staticmethod(current_stream)
    default_stream = staticmethod(default_stream)

    def __init__(self, count: int):
        self._count = count
        self._current = 0

    def is_available(self) -> bool:
        return _config["enabled"]

    def is_initialized(self) -> bool:
        return True

    def _is_in_bad_fork(self) -> bool:
        return False

    def device_count(self) -> int:
        return self._count if _config["enabled"] else 0

    def current_device(self) -> int:
        return self._current

    def set_device(self, device) -> None:
        self._current = device if isinstance(device, int) else (torch.device(device).index or 0)

    def get_device_name(self, device=None) -> str:
        return "kconvert stand-in (CPU-backed)"

    def manual_seed_all(self, seed: int) -> None:
        pass

    def synchronize(self, device=None) -> None:
        for mark in list(_pending.values()):
            mark.wait()
        _pending.clear()

    def memory_allocated(self, device=None) -> int:
        return STATS.allocated

    def max_memory_allocated(self, device=None) -> int:
        return STATS.peak

    def memory_reserved(self, device=None) -> int:
        return STATS.allocated

    def reset_peak_memory_stats(self, device=None) -> None:
        STATS.peak = STATS.allocated

    def memory_stats(self, device=None) -> dict:
        return {"allocated_bytes.all.current": STATS.allocated, "allocated_bytes.all.peak": STATS.peak}

    def empty_cache(self) -> None:
        pass

    def get_amp_supported_dtype(self):
        return [torch.float16, torch.bfloat16]


class _Hooks(torch._C._acc.PrivateUse1Hooks):
    def is_available(self) -> bool:
        return _config["enabled"]

    def has_primary_context(self, device_index) -> bool:
        return True

    def is_built(self) -> bool:
        return True


class _Guard(torch._C._acc.DeviceGuard):
    def type_(self):
        return torch._C._autograd.DeviceType.PrivateUse1


_installed: list = []


def install(count: int = 2) -> torch.device:
    """Register the `standin` device (once per process; later calls just enable it again)."""
    enable(True)
    if _installed:
        return torch.device(NAME, 0)
    taken = torch._C._get_privateuse1_backend_name()
    if taken != "privateuseone":
        raise RuntimeError(f"the PrivateUse1 backend is already {taken!r}: the stand-in cannot register")
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    _setup_privateuseone_for_python_backend(NAME, backend_module=DeviceModule(count), hook=_Hooks(),
                                            device_guard=_Guard())
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("empty.memory_format", _empty, "PrivateUse1")
    lib.impl("empty_strided", _empty_strided, "PrivateUse1")
    lib.impl("_pin_memory", _pin_memory, "CPU")  # no Python hook for a PrivateUse1 pinned allocator
    lib.impl("is_pinned", _is_pinned, "CPU")
    _installed.append(lib)  # the registrations live as long as the library object
    return torch.device(NAME, 0)
