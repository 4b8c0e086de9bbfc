"""How DeepSeek-V4's cached rows are laid out as bytes (docs/KV_CACHE.md, "DeepSeek-V4").

A K=V row (a sliding-window key or a compressed entry: `head_dim` values whose last `rope` carry RoPE) is one
flat uint8 row, so the cache's pages and ring never look at dtypes:
- native (no --kv-dtype): the compute dtype's bytes;
- bf16: 2 * head_dim bytes;
- fp8, the serving engines' layout for V4: [no-rope part e4m3 | rope part bf16 | one ue8m0 scale byte per
  64 values | zero pad to 8 B] = 584 B at 512 / 64 (a power-of-two scale per tile: 2^ceil(log2(amax / 448)));
- int8: [no-rope part int8 | rope part bf16 | one float32 scale per 64 values (amax / 127) | pad to 8 B].
The rope part stays bf16 in every 8-bit code: it carries the position. Indexer keys are engine.cache.row_format
rows (bf16, or fp8 = e4m3 + one float32 scale per 128: 132 B at 128). Byte counts equal
kconvert.kv_rows' (tests/families/dsv4/test_dsv4_cache.py)."""

from __future__ import annotations

import math

import torch

from engine.cache.row_format import E4M3_MAX, FP8, RowFormat, quantize_int8
from kconvert.kv_rows import V4_SCALE_GROUP, v4_entry_bytes


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


class EntryFormat:
    """K=V rows [..., head_dim] <-> uint8 [..., row_bytes] in one code (None: the compute dtype)."""

    def __init__(self, head_dim: int, rope: int, code: str | None, native: torch.dtype):
        self.dim, self.rope, self.code, self.native = head_dim, rope, code, native
        self.plain = head_dim - rope  # the values that get the 8-bit code
        self.tiles = math.ceil(self.plain / V4_SCALE_GROUP)
        self.row_bytes = head_dim * native.itemsize if code is None else v4_entry_bytes(head_dim, rope, code)

    @property
    def exact(self) -> bool:
        """Rows come back bit for bit (no rounding on the way in)."""
        return self.code is None

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        if self.code is None:
            return _bytes(x.to(self.native))
        if self.code == "bf16":
            return _bytes(x.to(torch.bfloat16))
        main, rope = x[..., :self.plain], x[..., self.plain:]
        if self.code == "fp8":
            q, scale = quantize_fp8_pow2(main, V4_SCALE_GROUP)
            scale = (torch.log2(scale).round() + 127).to(torch.uint8)  # ue8m0: the exponent byte
        else:
            q, scale = quantize_int8(main, V4_SCALE_GROUP)
        parts = [_bytes(q), _bytes(rope.to(torch.bfloat16)), _bytes(scale)]
        used = sum(p.shape[-1] for p in parts)
        if used < self.row_bytes:
            parts.append(x.new_zeros(*x.shape[:-1], self.row_bytes - used, dtype=torch.uint8))
        return torch.cat(parts, -1)

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.code is None:
            return rows.contiguous().view(self.native).to(dtype)
        if self.code == "bf16":
            return rows.contiguous().view(torch.bfloat16).to(dtype)
        p, r, g = self.plain, self.rope, self.tiles
        rope = rows[..., p:p + 2 * r].contiguous().view(torch.bfloat16)
        if self.code == "fp8":
            q = rows[..., :p].contiguous().view(FP8).float()
            scale = torch.exp2(rows[..., p + 2 * r:p + 2 * r + g].float() - 127)
        else:
            q = rows[..., :p].contiguous().view(torch.int8).float()
            scale = rows[..., p + 2 * r:p + 2 * r + 4 * g].contiguous().view(torch.float32)
        q = torch.nn.functional.pad(q, (0, g * V4_SCALE_GROUP - p)).unflatten(-1, (g, V4_SCALE_GROUP))
        main = (q * scale[..., None]).flatten(-2)[..., :p]
        return torch.cat([main.to(dtype), rope.to(dtype)], -1)

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        """x as the cache will give it back (what attention sees, so chunking never changes a result)."""
        return x if self.exact else self.decode(self.encode(x), x.dtype)


def quantize_fp8_pow2(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] -> (e4m3 [..., n], power-of-two float32 scales [..., ceil(n/group)]): the smallest power of
    two with amax / scale <= 448, so no value saturates."""
    n = x.shape[-1]
    g = math.ceil(n / group)
    xf = torch.nn.functional.pad(x.float(), (0, g * group - n)).unflatten(-1, (g, group))
    amax = xf.abs().amax(-1).clamp_min(2.0 ** -100)  # an all-zero tile keeps a finite scale
    scale = torch.exp2(torch.ceil(torch.log2(amax / E4M3_MAX)))
    q = (xf / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8).flatten(-2)[..., :n]
    return q, scale


def key_format(index_dim: int, code: str | None, native: torch.dtype) -> RowFormat:
    """The indexer keys' rows: engine.cache.row_format's (fp8: e4m3 + a float32 scale per 128 values)."""
    return RowFormat(index_dim, 0, code, native)

