"""Linear weights in their stored form, dequantized to the compute dtype on each call (or once, by
`materialize`). One module class per stored format:

- `PlainLinear`: `weight` (bf16 / fp32), cast to the compute dtype;
- one `SchemeLinear` subclass per quantization scheme of `kconvert.quant.registry` (fp8, int8, int4,
  fp4, and whatever is registered next): its stored tensors are the scheme's `specs`, its dense weight
  the scheme's `dequantize`, computed in the compute dtype. A new scheme needs nothing here.

Layer modules hold a `LinearSlot` where a linear goes; `resolve_linears` replaces each by the class of its
stored format, as the converted checkpoint's catalog records it (kconvert.json `tensors[*].transform`),
or, for tensors the catalog does not describe, as the tensors present (names and dtypes) show it."""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.slots import slot
from kconvert.errors import CheckpointError
from kconvert.io.dtypes import DTYPES
from kconvert.quant.registry import REGISTRY
from kconvert.quant.scheme import Options, Scheme


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


class SchemeLinear(StoredLinear):
    """A linear stored by a quantization scheme; `opts` are the conversion's (kconvert.json quantization)."""

    SCHEME: Scheme
    TAGS: tuple[str, ...] = ()  # safetensors dtype tags of STORED, in order

    def __init__(self, opts: Options | None = None):
        super().__init__()
        self.opts = opts or Options()

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        return self.SCHEME.dequantize([getattr(self, n) for n in self.STORED], self.opts, dtype)


@functools.cache
def linear_class(scheme: Scheme) -> type[SchemeLinear]:
    """The module class of a scheme's stored linears (one per scheme, made once)."""
    specs = scheme.specs("weight", (2 * 128, 2 * 128), Options())  # names and tags do not depend on the shape
    cls_name = "".join(part.capitalize() for part in scheme.name.split("_")) + "Linear"
    return type(cls_name, (SchemeLinear,), {"SCHEME": scheme, "STORED": tuple(n for n, _, _ in specs),
                                            "TAGS": tuple(t for _, t, _ in specs), "__module__": __name__})


# kconvert.json `tensors[*].transform` of a weight -> the class that reads it (convert/shard/plan.py writes them)
BY_TRANSFORM: dict[str, type[StoredLinear]] = {"copy": PlainLinear, "bf16": PlainLinear}
for _scheme in REGISTRY.values():
    if _scheme.shard:  # what a converted checkpoint can hold
        BY_TRANSFORM[_scheme.name] = linear_class(_scheme)
        for _copy in _scheme.copies:
            BY_TRANSFORM[_copy] = linear_class(_scheme)


def options_of(quantization: dict | None) -> Options:
    """The scheme options a conversion recorded (kconvert.json `quantization`)."""
    q = quantization or {}
    block = {"fp8_block": int(q["block_size"][0])} if q.get("block_size") else {}
    return Options(**{k: q[k] for k in ("scale_format", "group_size", "int4_scales") if q.get(k)}, **block)


def format_of(name: str, transforms: dict[str, str], tensors: dict[str, torch.Tensor],
              opts: Options | None = None) -> Callable[[], StoredLinear]:
    """A maker of linear `name` (its path, without `.weight`): the class of the catalog's record of its
    stored tensors, else the scheme whose stored names and dtypes the unit holds, else plain."""
    for part in ("weight", "weight_packed"):
        transform = transforms.get(f"{name}.{part}")
        if transform in BY_TRANSFORM:
            return _maker(BY_TRANSFORM[transform], opts)

    def holds(cls) -> bool:  # every stored tensor of the class, in its dtype
        return all(getattr(tensors.get(f"{name}.{n}"), "dtype", None) == DTYPES[t] for n, t in zip(cls.STORED, cls.TAGS))

    for cls in dict.fromkeys(BY_TRANSFORM.values()):
        if cls is not PlainLinear and holds(cls):
            return _maker(cls, opts)
    w = tensors.get(f"{name}.weight")
    if w is not None and w.dtype in (torch.float8_e4m3fn, torch.int8):
        raise CheckpointError("quantized weight without its scale", tensor=f"{name}.weight")
    return PlainLinear


def _maker(cls: type[StoredLinear], opts: Options | None) -> Callable[[], StoredLinear]:
    return functools.partial(cls, opts) if issubclass(cls, SchemeLinear) else cls


def resolve_linears(module: nn.Module, prefix: str, choose: Callable[[str], Callable[[], StoredLinear]]) -> None:
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
