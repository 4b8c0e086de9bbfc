"""What vLLM's model construction lacks on this CPU, lent for a load check (driver.py, in the vLLM environment).

Building a quantized layer makes vLLM choose its kernel, and this CPU may have none (vLLM-CPU's quantized MoE and
FP8 GEMMs need AMX or AVX-512): `claim_kernels` lets the choice go through (the first candidate, as if supported) and
names each claim. Parameters are made by the quantization method, not by the kernel, so what loads is what vLLM
loads on a machine that has the kernel; nothing here runs one.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

import torch

CLAIMED: list[str] = []  # what construction was lent, in order (driver.py reports each item's share)


class _NoEvent:
    """A stand-in for torch.cuda.Event / Stream on a CPU torch, for construction only (nothing is recorded)."""

    def __init__(self, *a, **k):
        CLAIMED.append("torch.cuda.Event: a do-nothing stand-in (vLLM-CPU's V4 attention makes CUDA events)")

    def __getattr__(self, name):
        return lambda *a, **k: None


def lend_cuda_events() -> None:
    """vLLM-CPU 0.32.0 builds DeepSeek-V4's attention with `torch.cuda.Event()` objects (models/deepseek_v4/
    attention.py, `self.ln_events`), which a CPU build of torch refuses to construct ("Tried to instantiate dummy base
    class Event"): an upstream bug on the CPU path. Construction gets do-nothing events; no forward runs here."""
    if not torch.cuda.is_available():
        torch.cuda.Event = torch.cuda.Stream = _NoEvent


def claim_kernels() -> list[str]:
    """Let vLLM build quantized layers whose kernels this CPU lacks (once per process); returns the list each claim
    is appended to."""
    if getattr(claim_kernels, "done", False):
        return CLAIMED
    claim_kernels.done = True
    claimed = CLAIMED
    lend_cuda_events()
    torch.cpu._is_amx_tile_supported = lambda: True  # the AMX check of vLLM-CPU's MoE and GEMM kernels
    import vllm.model_executor.kernels.linear as kl

    check, choose = kl.is_supported_and_can_implement_kernel, kl.choose_scaled_mm_linear_kernel

    def chosen(*a, **k):
        try:
            return choose(*a, **k)
        except ValueError as e:  # no kernel: take the first, as if it were supported
            claimed.append("linear GEMM: " + str(e).strip().splitlines()[-1].rstrip("."))
            kl.is_supported_and_can_implement_kernel = lambda *_a, **_k: (True, None)
            try:
                return choose(*a, **k)
            finally:
                kl.is_supported_and_can_implement_kernel = check

    kl.choose_scaled_mm_linear_kernel = chosen
    _claim_moe_backends(claimed)
    return claimed


def _claim_moe_backends(claimed: list[str]) -> None:
    """vLLM's MoE methods ask an oracle (`select_*_moe_backend`) for their kernel; one that finds none raises. Each
    oracle, wherever a method imported it, is wrapped to answer (None, None) then: the method builds its parameters
    without a kernel."""
    import vllm.model_executor.layers.fused_moe.oracle as oracle
    import vllm.model_executor.layers.quantization as quantization

    for pkg in (oracle, quantization):
        for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            try:
                importlib.import_module(m.name)
            except Exception:  # a method for other hardware: not what this CPU loads
                pass
    oracles = {}
    for name, mod in list(sys.modules.items()):
        if name.startswith(oracle.__name__ + "."):
            oracles.update({id(f): (f, a) for a, f in vars(mod).items()
                            if a.startswith("select_") and a.endswith("_backend") and callable(f)})

    def claim(fn, attr):
        def selected(*a, **k):
            try:
                return fn(*a, **k)
            except (NotImplementedError, ValueError) as e:
                claimed.append(f"{attr}: {str(e).splitlines()[0][:120]}")
                return None, None
        return selected

    wrapped = {i: claim(f, a) for i, (f, a) in oracles.items()}
    for name, mod in list(sys.modules.items()):
        if name.startswith("vllm."):
            for attr, val in list(vars(mod).items()):
                if callable(val) and id(val) in wrapped:
                    setattr(mod, attr, wrapped[id(val)])
