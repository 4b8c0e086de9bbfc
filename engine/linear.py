"""Linear weights in their stored form, one module class per format, dequantized to the compute dtype
on each call (or once, by `materialize`):

| class | stored tensors | dequantized |
|---|---|---|
| PlainLinear | `weight` | `weight` in the compute dtype |
| BlockFp8Linear | `weight` e4m3 + `weight_scale_inv` [ceil(out/128), ceil(in/128)] | `weight * scale` per 128x128 block |
| Int8ChannelLinear | `weight` int8 + `weight_scale` [out, 1] | `weight * scale` per row |
| Int4GroupLinear | `weight_packed` uint8 [out, in/2] (two nibbles, -8 offset) + `weight_scale` [out, in/G] | `q * scale` per group |

Layer modules hold a `LinearSlot` where a linear goes; `resolve_linears` replaces each by the class of its
stored format, as the converted checkpoint's catalog records it (kconvert.json `tensors[*].transform`),
or, for tensors the catalog does not describe, as the tensors present show it."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.slots import slot
from kconvert.errors import CheckpointError
from kconvert.io.dtypes import FP8_BLOCK


class LinearSlot(nn.Module):
    """Where a linear goes, before its stored format is known (resolve_linears replaces it)."""


class StoredLinear(nn.Module):
    """x @ W^T with W [out, in] dequantized from the stored tensors `STORED`."""

    STORED: tuple[str, ...] = ()

    def __init__(self):
        super().__init__()
        for name in self.STORED:
            slot(self, name)

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dense(x.dtype))

    def dequantized(self, dtype: torch.dtype) -> "PlainLinear":
        """A plain copy holding the dense weight (trades memory for speed where dequantizing per call is slow)."""
        return PlainLinear.holding(self.dense(dtype).contiguous())


class PlainLinear(StoredLinear):
    STORED = ("weight",)

    @classmethod
    def holding(cls, weight: torch.Tensor) -> "PlainLinear":
        lin = cls()
        lin.weight = weight
        return lin

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        return self.weight if self.weight.dtype == dtype else self.weight.to(dtype)


class BlockFp8Linear(StoredLinear):
    STORED = ("weight", "weight_scale_inv")

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        out, inp = self.weight.shape
        s = self.weight_scale_inv.to(dtype).repeat_interleave(FP8_BLOCK, 0)[:out].repeat_interleave(FP8_BLOCK, 1)[:, :inp]
        return self.weight.to(dtype) * s


class Int8ChannelLinear(StoredLinear):
    STORED = ("weight", "weight_scale")

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        return self.weight.to(dtype) * self.weight_scale.to(dtype)


class Int4GroupLinear(StoredLinear):
    STORED = ("weight_packed", "weight_scale")

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        p = self.weight_packed
        q = torch.stack([p & 0xF, p >> 4], dim=-1).view(p.shape[0], -1).to(dtype) - 8
        return q * self.weight_scale.to(dtype).repeat_interleave(q.shape[1] // self.weight_scale.shape[1], 1)


# kconvert.json `tensors[*].transform` of a weight -> the class that reads it (convert/shard_plan.py writes them)
BY_TRANSFORM: dict[str, type[StoredLinear]] = {
    "copy": PlainLinear, "bf16": PlainLinear, "fp8": BlockFp8Linear, "fp8_copy": BlockFp8Linear,
    "int8": Int8ChannelLinear, "int4": Int4GroupLinear,
}


def format_of(name: str, transforms: dict[str, str], tensors: dict[str, torch.Tensor]) -> type[StoredLinear]:
    """The class of linear `name` (its path, without `.weight`): the catalog's record of `name.weight` (or
    `name.weight_packed`), else what the unit holds."""
    for stored in (f"{name}.weight", f"{name}.weight_packed"):
        if transforms.get(stored) in BY_TRANSFORM:
            return BY_TRANSFORM[transforms[stored]]
    if f"{name}.weight_packed" in tensors:
        return Int4GroupLinear
    if f"{name}.weight_scale_inv" in tensors:
        return BlockFp8Linear
    if f"{name}.weight_scale" in tensors:
        return Int8ChannelLinear
    w = tensors.get(f"{name}.weight")
    if w is not None and w.dtype in (torch.float8_e4m3fn, torch.int8):
        raise CheckpointError("quantized weight without its scale", tensor=f"{name}.weight")
    return PlainLinear


def resolve_linears(module: nn.Module, prefix: str, choose: Callable[[str], type[StoredLinear]]) -> None:
    """Replace every LinearSlot under `module` (checkpoint prefix `prefix`) by `choose(its stored name)`()."""
    for path, parent in list(module.named_modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, LinearSlot):
                setattr(parent, name, choose(f"{prefix}{path}.{name}" if path else f"{prefix}{name}")())


def materialize(module: nn.Module, dtype: torch.dtype) -> None:
    """Dequantize every linear under `module` once to a dense `dtype` weight."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, StoredLinear):
                setattr(parent, name, child.dequantized(dtype))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(x.dtype) * xf.to(x.dtype)


class RMSNorm(nn.Module):
    """`weight` [dim]; computed in float32, scaled in the input's dtype."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps
        slot(self, "weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class WeightAndBias(nn.Module):
    """`weight` + `bias` of a layer norm or a biased linear, applied by its owner (vision tower, indexer)."""

    def __init__(self):
        super().__init__()
        slot(self, "weight")
        slot(self, "bias")
