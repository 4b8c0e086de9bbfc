"""A CPU-backed stand-in accelerator, `standin`, registered the way torch_musa registers `musa`.

    from kconvert.testing import standin
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

Test support, shipped in the library so `tools/device_check.py --device standin` can dry-run the GPU
script on any machine. Installing is once per process and cannot be undone; `enable(False)` makes
the device unavailable again (torch.accelerator included) for code that asks for `auto`.

Over 300 lines because the tensor subclass, its dispatch rules and the device module must agree on
one set of private state (streams and pending copies live in standin_streams.py)."""

from __future__ import annotations

import threading
import time
import weakref
import zlib

import torch
from torch.utils._pytree import tree_map

from kconvert.testing.standin_streams import (NAME, STATS, Event, Stream, current_stream, default_stream, drain,
                                           pending, stream, wait_pending)

POISON = 0xA5
aten = torch.ops.aten
__all__ = ["NAME", "STATS", "Event", "Stream", "install", "enable", "configure", "reset_stats", "raw", "in_flight"]

_config = {"copy_delay": 0.0, "enabled": True}
_lock = threading.Lock()
_pinned: dict[int, int] = {}          # storage data_ptr -> bytes, for pinned host buffers
_storages: dict[int, list] = {}       # storage data_ptr -> [bytes, live wrappers]


def reset_stats() -> None:
    with _lock:
        allocated = STATS.allocated
        STATS.__init__(allocated=allocated, peak=allocated)  # in place: importers hold this object


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
    return _fresh(torch.empty(size, dtype=dtype), device)


def _empty_strided(size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
    return _fresh(torch.empty_strided(size, stride, dtype=dtype), device)


def _fresh(data: torch.Tensor, device) -> StandinTensor:
    """New device memory holds garbage, not zeros: code that reads it before writing must not pass."""
    if data.numel():
        data.untyped_storage().fill_(POISON)
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


# ------------------------------------------------------------------ copies


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
    pending[raw(dst).untyped_storage().data_ptr()] = side._submit(run)
    return dst


def _wait_pending(tensors) -> None:
    wait_pending([t.raw.untyped_storage().data_ptr() for t in tensors if _is_dev(t)])


def in_flight(t: torch.Tensor) -> bool:
    """Whether a queued copy into t's device memory has not run yet."""
    mark = pending.get(raw(t).untyped_storage().data_ptr())
    return mark is not None and not mark.is_set()


# ------------------------------------------------------------------ the device module


class DeviceModule:
    """What `torch.get_device_module("standin")` returns: the part of torch.cuda's surface that
    generic device code (kconvert.devices, torch.accelerator) calls."""

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
        drain()

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
