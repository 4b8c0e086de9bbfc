"""How one token's KV entry is laid out as bytes: every cache row is a flat uint8 row, so paging, the
host tier and byte accounting never need to know the dtype (docs/KV_CACHE.md).

Latent row (MLA): [latent | scales | rope]
- native (the compute dtype, the default): latent and rope in that dtype, no scales;
- bf16: latent and rope in bf16;
- fp8: latent in float8_e4m3fn with one float32 scale per `group` values (amax / 448 per tile), rope
  in bf16 (its rotation is position-sensitive and it is only 1/9 of the row).
Indexer row: the key in bf16, or fp8 with one float32 scale per 128 values (per token at 128 dims).
The byte counts equal kconvert.plan.kv_bytes' figures for bf16 / fp8 (tests/test_kv_cache.py)."""

from __future__ import annotations

import math

import torch

from kconvert.errors import UsageError
from kconvert.plan.kv_bytes import KV_DTYPES, SCALE_GROUP

E4M3_MAX = 448.0
FP8 = torch.float8_e4m3fn


def check_kv_dtype(kv_dtype: str | None) -> str | None:
    if kv_dtype is not None and kv_dtype not in KV_DTYPES:
        raise UsageError(f"unknown --kv-dtype {kv_dtype!r} (choose from {', '.join(KV_DTYPES)})")
    return kv_dtype


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _from_bytes(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return b.contiguous().view(dtype)


class RowFormat:
    """Encoding of [..., width] values (a quantized part followed by an optional bf16 tail) as byte rows."""

    def __init__(self, width: int, tail: int, kv_dtype: str | None, native: torch.dtype, group: int = SCALE_GROUP):
        self.width, self.tail, self.kv_dtype, self.group = width, tail, kv_dtype, group
        self.store = native if kv_dtype is None else torch.bfloat16
        if kv_dtype == "fp8":
            self.groups = math.ceil(width / group)
            self.row_bytes = width + 4 * self.groups + 2 * tail
        else:
            self.row_bytes = (width + tail) * self.store.itemsize

    def encode(self, main: torch.Tensor, tail: torch.Tensor | None = None) -> torch.Tensor:
        """main [..., width] (+ tail [..., tail]) -> uint8 [..., row_bytes]."""
        if self.kv_dtype != "fp8":
            parts = [main] if tail is None else [main, tail]
            return _as_bytes(torch.cat([p.to(self.store) for p in parts], -1))
        q, scale = quantize_fp8(main, self.group)
        parts = [_as_bytes(q), _as_bytes(scale)]
        if tail is not None:
            parts.append(_as_bytes(tail.to(torch.bfloat16)))
        return torch.cat(parts, -1)

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """uint8 [..., row_bytes] -> (main [..., width], tail [..., tail] or None) in dtype."""
        w, t = self.width, self.tail
        if self.kv_dtype != "fp8":
            v = _from_bytes(rows, self.store).to(dtype)
            return v[..., :w], (v[..., w:] if t else None)
        q = _from_bytes(rows[..., :w], FP8)
        scale = _from_bytes(rows[..., w:w + 4 * self.groups], torch.float32)
        main = dequantize_fp8(q, scale, self.group).to(dtype)
        tail = _from_bytes(rows[..., w + 4 * self.groups:], torch.bfloat16).to(dtype) if t else None
        return main, tail


def quantize_fp8(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] -> (e4m3 [..., n], float32 scales [..., ceil(n/group)]) with x ~= q * scale per tile."""
    n = x.shape[-1]
    g = math.ceil(n / group)
    xf = torch.nn.functional.pad(x.float(), (0, g * group - n)).unflatten(-1, (g, group))
    scale = (xf.abs().amax(-1) / E4M3_MAX).clamp_min(1e-12)  # an all-zero tile keeps a finite scale
    q = (xf / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8).flatten(-2)[..., :n]
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    n = q.shape[-1]
    return (q.float() * scale.repeat_interleave(group, -1)[..., :n])
