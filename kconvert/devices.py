"""Device selection through torch's generic device-module APIs, so cuda, musa (torch_musa registers
`musa` as the renamed PrivateUse1 backend) and the CPU-backed `standin` (kconvert/testing/standin.py)
take the same code path, and an absent device is a clear error.

This is the only module that names an accelerator type; everything else asks it (a test greps the
tree for that)."""

from __future__ import annotations

import torch

from kconvert.errors import DeviceError

KNOWN = ("cuda", "musa")  # probed even when torch.accelerator does not report them
COLLECTIVES = {"cpu": "gloo", "cuda": "nccl", "musa": "mccl"}


def module(kind: str | torch.device):
    """torch.cuda, torch.musa, ... for a device type (or device), or None when torch has none."""
    kind = kind.type if isinstance(kind, torch.device) else kind
    try:
        return torch.get_device_module(kind)
    except (RuntimeError, AttributeError):
        return None


def _usable(kind: str) -> bool:
    mod = module(kind)
    try:
        return mod is not None and bool(mod.is_available())
    except (RuntimeError, AttributeError):
        return False


def kinds() -> list[str]:
    """Accelerator types this process knows: the known ones plus torch.accelerator's current one."""
    out = list(KNOWN)
    acc = getattr(torch, "accelerator", None)
    if acc is not None:
        try:
            cur = acc.current_accelerator(check_available=False)
        except (TypeError, RuntimeError):
            cur = acc.current_accelerator() if acc.is_available() else None
        if cur is not None and cur.type not in out:
            out.append(cur.type)
    return out


def accelerator_type() -> str | None:
    """'cuda', 'musa', ... when an accelerator is usable, else None."""
    acc = getattr(torch, "accelerator", None)
    if acc is not None and acc.is_available():
        return acc.current_accelerator().type
    return next((k for k in KNOWN if _usable(k)), None)


def resolve(spec: str | torch.device | None = "auto") -> torch.device:
    """'auto' (the accelerator if any, else cpu), 'cpu', 'cuda', 'cuda:1', 'musa:0', ..."""
    if spec is None or str(spec) == "auto":
        kind = accelerator_type()
        return torch.device(f"{kind}:0") if kind else torch.device("cpu")
    try:
        dev = torch.device(spec)
    except (RuntimeError, ValueError):
        raise DeviceError(f"unknown device {spec!r} (use cpu, {', '.join(f'{k}[:i]' for k in kinds())} "
                          f"or auto)") from None
    if dev.type == "cpu":
        return dev
    if not _usable(dev.type):
        hint = " (install torch_musa for Moore Threads GPUs)" if dev.type == "musa" else ""
        raise DeviceError(f"device {spec!r} is not available on this machine{hint}; available: "
                          f"{', '.join(available())}")
    mod = module(dev.type)
    index = dev.index if dev.index is not None else 0
    if index >= mod.device_count():
        raise DeviceError(f"device {spec!r} does not exist: this machine has {mod.device_count()} {dev.type} device(s)")
    return torch.device(dev.type, index)


def available() -> list[str]:
    out = ["cpu"]
    for kind in kinds():
        if _usable(kind):
            out += [f"{kind}:{i}" for i in range(module(kind).device_count())]
    return out


def count(kind: str | None = None) -> int:
    """How many devices of `kind` (default: the accelerator) this machine has."""
    kind = kind or accelerator_type()
    return module(kind).device_count() if kind and _usable(kind) else 0


def synchronize(dev: torch.device) -> None:
    if dev.type != "cpu":
        module(dev).synchronize(dev)


def set_current(dev: torch.device) -> None:
    """Make `dev` the process's current device (one accelerator per torchrun process)."""
    if dev.type != "cpu":
        module(dev).set_device(dev.index or 0)


def collective_backend(dev: str | torch.device) -> str:
    """torch.distributed backend for a device type: gloo on cpu, nccl on cuda, mccl on musa."""
    kind = torch.device(dev).type
    if kind not in COLLECTIVES:
        raise DeviceError(f"no distributed backend for device type {kind!r} (known: {', '.join(COLLECTIVES)})")
    return COLLECTIVES[kind]


def pinned_empty(nbytes: int) -> torch.Tensor:
    """Page-locked host bytes, the source a non-blocking host-to-device copy needs."""
    return torch.empty(nbytes, dtype=torch.uint8).pin_memory()


def memory_allocated_peak(dev: torch.device) -> int | None:
    if dev.type == "cpu":
        return None
    fn = getattr(module(dev), "max_memory_allocated", None)
    return int(fn(dev)) if fn else None
