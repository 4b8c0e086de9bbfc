"""How one token's KV entry is laid out as bytes: every cache row is a flat uint8 row, so paging,
the host tier and byte accounting never need to know the dtype (docs/KV_CACHE.md).

A row is [values | scales | tail], its values in one *code*:
- native (the compute dtype, the default): values and tail in that dtype, no scales;
- bf16: values and tail in bf16;
- fp8: float8_e4m3fn values, one float32 scale per `group` values (amax / 448 per tile);
- int8: int8 values, one float32 scale per `group` values (amax / 127 per tile, round to nearest).
The tail (the latent row's rope part) is bf16 in every 8-bit code: its rotation carries the position and
it is only 1/9 of the row. Which code the latent and the indexer key get under each --kv-dtype is
kconvert.kv_rows.LATENT_CODE and INDEX_CODE; the byte counts equal plan's (tests/engine/test_kv_cache.py)."""

from __future__ import annotations

import math

import torch

from kconvert.errors import UsageError
from kconvert.kv_rows import INDEX_CODE, KV_DTYPES, LATENT_CODE, ROW_CODES, SCALE_GROUP

E4M3_MAX = 448.0
INT8_MAX = 127.0
FP8 = torch.float8_e4m3fn


def check_kv_dtype(kv_dtype: str | None) -> str | None:
    if kv_dtype is not None and kv_dtype not in KV_DTYPES:
        raise UsageError(f"unknown --kv-dtype {kv_dtype!r} (choose from {', '.join(KV_DTYPES)})")
    return kv_dtype


def row_codes(kv_dtype: str | None, index_dtype: str | None = None) -> tuple[str | None, str | None]:
    """(latent code, indexer-key code) of a --kv-dtype; `index_dtype` overrides the key's code."""
    if index_dtype is not None and index_dtype not in ROW_CODES:
        raise UsageError(f"unknown indexer key code {index_dtype!r} (choose from {', '.join(ROW_CODES)})")
    if kv_dtype is None:
        return None, index_dtype
    return LATENT_CODE[kv_dtype], index_dtype or INDEX_CODE[kv_dtype]


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _from_bytes(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return b.contiguous().view(dtype)


class RowFormat:
    """Encoding of [..., width] values (plus an optional bf16 tail of `tail` values) as byte rows."""

    def __init__(self, width: int, tail: int, code: str | None, native: torch.dtype, group: int = SCALE_GROUP):
        self.width, self.tail, self.code, self.group = width, tail, code, group
        self.store = native if code is None else torch.bfloat16
        self.scaled = code in ("fp8", "int8")
        if self.scaled:
            self.groups = math.ceil(width / group)
            self.row_bytes = width + 4 * self.groups + 2 * tail
        else:
            self.row_bytes = (width + tail) * self.store.itemsize

    def encode(self, main: torch.Tensor, tail: torch.Tensor | None = None) -> torch.Tensor:
        """main [..., width] (+ tail [..., tail]) -> uint8 [..., row_bytes]."""
        if not self.scaled:
            parts = [main] if tail is None else [main, tail]
            return _as_bytes(torch.cat([p.to(self.store) for p in parts], -1))
        q, scale = (quantize_fp8 if self.code == "fp8" else quantize_int8)(main, self.group)
        parts = [_as_bytes(q), _as_bytes(scale)]
        if tail is not None:
            parts.append(_as_bytes(tail.to(torch.bfloat16)))
        return torch.cat(parts, -1)

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """uint8 [..., row_bytes] -> (main [..., width], tail [..., tail] or None) in dtype."""
        w, t = self.width, self.tail
        if not self.scaled:
            v = _from_bytes(rows, self.store).to(dtype)
            return v[..., :w], (v[..., w:] if t else None)
        q = _from_bytes(rows[..., :w], FP8 if self.code == "fp8" else torch.int8)
        scale = _from_bytes(rows[..., w:w + 4 * self.groups], torch.float32)
        main = dequantize(q, scale, self.group).to(dtype)
        tail = _from_bytes(rows[..., w + 4 * self.groups:], torch.bfloat16).to(dtype) if t else None
        return main, tail


def _tiles(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [..., n] as float32 tiles [..., ceil(n/group), group] (the last one zero-padded)."""
    n = x.shape[-1]
    g = math.ceil(n / group)
    return torch.nn.functional.pad(x.float(), (0, g * group - n)).unflatten(-1, (g, group))


def quantize_fp8(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] -> (e4m3 [..., n], float32 scales [..., ceil(n/group)]) with x ~= q * scale per tile."""
    xf = _tiles(x, group)
    scale = (xf.abs().amax(-1) / E4M3_MAX).clamp_min(1e-12)  # an all-zero tile keeps a finite scale
    q = (xf / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8).flatten(-2)[..., :x.shape[-1]]
    return q, scale


def quantize_int8(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] -> (int8 [..., n], float32 scales) with x ~= q * scale, |error| <= scale / 2 per value."""
    xf = _tiles(x, group)
    scale = (xf.abs().amax(-1) / INT8_MAX).clamp_min(1e-12)
    q = (xf / scale[..., None]).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8).flatten(-2)[..., :x.shape[-1]]
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    n = q.shape[-1]
    if n % group == 0:  # the usual case: one broadcast multiply, no repeated scales
        return (q.float().unflatten(-1, (n // group, group)) * scale[..., None]).flatten(-2)
    return q.float() * scale.repeat_interleave(group, -1)[..., :n]

