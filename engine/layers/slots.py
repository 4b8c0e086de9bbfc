"""Checkpoint tensors as registered buffers that hold nothing until their unit arrives.

Engine modules declare each stored tensor with `slot(self, name)`: an uninitialized buffer on the meta
device (no bytes, no shape yet). `load_unit` checks a loader unit's tensors against the slots of the
modules that unit fills and assigns them in place with `load_state_dict(strict=True, assign=True)`:
the loader's tensors become the module's buffers without a copy, so memory is what the loader read.
Module attribute paths mirror the stored names, so a module's state_dict keys are the checkpoint's."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parameter import UninitializedBuffer, is_lazy

from kconvert.errors import CheckpointError

_OPTIONAL = "_optional_slots"  # slot names a module may lack in a checkpoint (set to None when absent)


def slot(module: nn.Module, name: str, *, optional: bool = False) -> None:
    """Declare stored tensor `name` of `module` (filled by load_unit)."""
    module.register_buffer(name, UninitializedBuffer(device="meta"))
    if optional:
        module.__dict__.setdefault(_OPTIONAL, set()).add(name)


class Stored(nn.Module):
    """A module holding one stored `weight` that is no linear (a conv kernel, a norm or mixing vector, an
    embedding table): a checkpoint name `X.weight` where X has nothing else."""

    def __init__(self, optional: bool = False):
        super().__init__()
        slot(self, "weight", optional=optional)


def slots_of(module: nn.Module) -> list[str]:
    """The stored-tensor names under `module`, relative to it (its state_dict keys)."""
    return [n for n, b in module.named_buffers(remove_duplicate=False) if b is not None]


def is_filled(module: nn.Module) -> bool:
    return not any(is_lazy(b) for _, b in module.named_buffers(remove_duplicate=False))


def holds_all(module: nn.Module) -> bool:
    """Every slot declared under `module` holds a tensor (none absent, none still empty)."""
    return all(b is not None and not is_lazy(b) for m in module.modules() for b in m._buffers.values())


def load_unit(unit: str, parts: dict[str, nn.Module], tensors: dict[str, torch.Tensor],
              ignore=lambda name: False) -> None:
    """Fill `parts` ({checkpoint prefix: module}) from one loader unit. Every tensor must fill a slot and
    every slot must be filled (optional ones may be absent); otherwise a CheckpointError names the first
    tensor (a zero-size tensor no slot takes is no error). `ignore(name)` drops a stored tensor the engine does not use on purpose (MTP extras)."""
    where: dict[str, tuple[str, nn.Module, str]] = {}
    for prefix, module in parts.items():
        optional = {f"{path}.{n}" if path else n for path, m in module.named_modules()
                    for n in m.__dict__.get(_OPTIONAL, ())}
        for name in slots_of(module):
            where[prefix + name] = (prefix, module, name)
            if name in optional and prefix + name not in tensors:
                owner, _, attr = name.rpartition(".")
                module.get_submodule(owner).register_buffer(attr, None)  # absent in this checkpoint
                del where[prefix + name]
    # a zero-size tensor holds nothing to use: a module the config sizes at 0 (a shared expert of
    # n_shared_experts 0, which transformers still builds 0 wide and saves) is no module here
    extra = [n for n in tensors if n not in where and not ignore(n) and tensors[n].numel()]
    if extra:
        raise CheckpointError(f"unit {unit}: {len(extra)} tensor(s) the engine does not use", tensor=extra[0])
    missing = [n for n in where if n not in tensors]
    if missing:
        raise CheckpointError(f"unit {unit}: tensor missing from the converted checkpoint", tensor=missing[0])
    for prefix, module in parts.items():
        state = {n[len(prefix):]: t for n, t in tensors.items() if n in where and where[n][0] == prefix}
        module.load_state_dict(state, strict=True, assign=True)
