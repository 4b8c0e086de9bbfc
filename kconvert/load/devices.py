"""Device selection through torch's generic device-module APIs, so cuda and musa (torch_musa
registers `musa`) take the same code path and an absent device is a clear error."""

from __future__ import annotations

import torch

from kconvert.errors import DeviceError


def _module(kind: str):
    try:
        return torch.get_device_module(kind)
    except (RuntimeError, AttributeError):
        return None


def accelerator_type() -> str | None:
    """'cuda', 'musa', ... when an accelerator is usable, else None."""
    acc = getattr(torch, "accelerator", None)
    if acc is not None and acc.is_available():
        return acc.current_accelerator().type
    for kind in ("cuda", "musa"):
        mod = _module(kind)
        if mod is not None and mod.is_available():
            return kind
    return None


def resolve(spec: str | torch.device | None = "auto") -> torch.device:
    """'auto' (the accelerator if any, else cpu), 'cpu', 'cuda', 'cuda:1', 'musa:0', ..."""
    if spec is None or str(spec) == "auto":
        kind = accelerator_type()
        return torch.device(f"{kind}:0") if kind else torch.device("cpu")
    try:
        dev = torch.device(spec)
    except (RuntimeError, ValueError):
        raise DeviceError(f"unknown device {spec!r} (use cpu, cuda[:i], musa[:i] or auto)") from None
    if dev.type == "cpu":
        return dev
    mod = _module(dev.type)
    if mod is None or not mod.is_available():
        hint = " (install torch_musa for Moore Threads GPUs)" if dev.type == "musa" else ""
        raise DeviceError(f"device {spec!r} is not available on this machine{hint}; available: "
                          f"{', '.join(available()) or 'cpu'}")
    index = dev.index if dev.index is not None else 0
    if index >= mod.device_count():
        raise DeviceError(f"device {spec!r} does not exist: this machine has {mod.device_count()} {dev.type} device(s)")
    return torch.device(dev.type, index)


def available() -> list[str]:
    out = ["cpu"]
    for kind in ("cuda", "musa"):
        mod = _module(kind)
        if mod is not None and mod.is_available():
            out += [f"{kind}:{i}" for i in range(mod.device_count())]
    return out


def synchronize(dev: torch.device) -> None:
    if dev.type != "cpu":
        _module(dev.type).synchronize(dev)


def memory_allocated_peak(dev: torch.device) -> int | None:
    if dev.type == "cpu":
        return None
    mod = _module(dev.type)
    fn = getattr(mod, "max_memory_allocated", None)
    return int(fn(dev)) if fn else None
