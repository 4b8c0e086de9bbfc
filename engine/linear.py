"""Weights kept in their converted form (bf16 / fp8 + 128x128 block scales / int8 + per-row scales /
int4 nibbles packed two per byte + per-group scales), dequantized to the compute dtype on each call."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kconvert.errors import KConvertError

BLOCK = 128


class Weight:
    """One linear weight [out, in] as stored; `dense(dtype)` dequantizes, `weight(x)` applies x @ W^T."""

    __slots__ = ("data", "scale", "kind")

    def __init__(self, data: torch.Tensor, scale: torch.Tensor | None = None, kind: str = "plain"):
        self.data, self.scale, self.kind = data, scale, kind

    @classmethod
    def take(cls, tensors: dict, name: str) -> "Weight":
        """Pop `name`.weight (+ its scale) out of a loaded unit."""
        if f"{name}.weight_packed" in tensors:  # int4: uint8 [out, in/2], float32 scale [out, in/group]
            if f"{name}.weight_scale" not in tensors:
                raise KConvertError("int4 weight without its scale", tensor=f"{name}.weight_packed")
            return cls(tensors.pop(f"{name}.weight_packed"), tensors.pop(f"{name}.weight_scale").float(), "int4")
        try:
            w = tensors.pop(f"{name}.weight")
        except KeyError:
            raise KConvertError("tensor missing from the converted checkpoint", tensor=f"{name}.weight") from None
        if f"{name}.weight_scale_inv" in tensors:
            return cls(w, tensors.pop(f"{name}.weight_scale_inv").float(), "fp8")
        if f"{name}.weight_scale" in tensors:
            return cls(w, tensors.pop(f"{name}.weight_scale").float(), "int8")
        if w.dtype in (torch.float8_e4m3fn, torch.int8):
            raise KConvertError("quantized weight without its scale", tensor=f"{name}.weight")
        return cls(w)

    @property
    def shape(self) -> torch.Size:
        if self.kind == "int4":
            return torch.Size((self.data.shape[0], 2 * self.data.shape[1]))
        return self.data.shape

    def nbytes(self) -> int:
        n = self.data.numel() * self.data.element_size()
        return n + (self.scale.numel() * 4 if self.scale is not None else 0)

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        if self.kind == "plain":
            return self.data if self.data.dtype == dtype else self.data.to(dtype)
        if self.kind == "int8":
            return self.data.to(dtype) * self.scale.to(dtype)
        if self.kind == "int4":
            q = torch.stack([self.data & 0xF, self.data >> 4], dim=-1).view(self.data.shape[0], -1).to(dtype) - 8
            return q * self.scale.to(dtype).repeat_interleave(q.shape[1] // self.scale.shape[1], 1)
        out, inp = self.data.shape
        s = self.scale.to(dtype).repeat_interleave(BLOCK, 0)[:out].repeat_interleave(BLOCK, 1)[:, :inp]
        return self.data.to(dtype) * s

    def materialize(self, dtype: torch.dtype) -> None:
        """Replace the stored form by a dense copy (trades memory for speed where dequantizing per call is slow)."""
        self.data, self.scale, self.kind = self.dense(dtype).contiguous(), None, "plain"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dense(x.dtype))

    def rows(self, start: int, stop: int) -> "Weight":
        """A view of output rows [start, stop) (block-aligned for fp8)."""
        if self.kind == "fp8":
            if start % BLOCK:
                raise KConvertError(f"fp8 row slice at {start} is not {BLOCK}-aligned")
            return Weight(self.data[start:stop], self.scale[start // BLOCK:(stop + BLOCK - 1) // BLOCK], "fp8")
        if self.kind == "int8":
            return Weight(self.data[start:stop], self.scale[start:stop], "int8")
        return Weight(self.data[start:stop])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(x.dtype) * xf.to(x.dtype)
