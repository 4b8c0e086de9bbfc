"""INT4 codes on disk: one packer and one unpacker per layout, and nowhere else.

- nibble pairs (kconvert's converted format, `shard --quant int4`): uint8 [R, C/2], nibble q + 8,
  even column in the low nibble.
- int32 words (compressed-tensors `pack-quantized`, Kimi's INT4 releases and `export --format w4a16`):
  int32 [R, C/8], nibble q + 8, eight per word, low nibble first.
Codes are int8 values -8..7.
"""

from __future__ import annotations

import functools
import sys

_ROWS_PER_STEP = 256  # int64 temporaries of a few rows at a time


@functools.cache
def _shifts():
    """Each nibble's shift in its int32 word, low nibble first (built on first use: no torch at import)."""
    import torch

    return torch.arange(8, dtype=torch.int64) * 4


def pack_nibble_pairs(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes -8..7 [R, C] -> uint8 [R, C/2]: q + 8, even column in the low nibble."""
    import torch

    u = (codes + 8).to(torch.uint8)
    return (u[:, 0::2] | (u[:, 1::2] << 4)).contiguous()


def unpack_nibble_pairs(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [R, C/2] -> int8 codes -8..7 [R, C] (low nibble = even column)."""
    import torch

    u = torch.stack([packed & 0xF, packed >> 4], dim=-1).view(packed.shape[0], -1)
    return u.to(torch.int8) - 8


def pack_int32_words(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes -8..7 [R, C] -> int32 [R, C/8]: nibble q + 8, eight per word, low nibble first."""
    import torch

    rows, cols = codes.shape
    out = torch.empty(rows, cols // 8, dtype=torch.int32)
    for r0 in range(0, rows, _ROWS_PER_STEP):
        c = codes[r0:r0 + _ROWS_PER_STEP]
        words = ((c.to(torch.int64) + 8).view(c.shape[0], cols // 8, 8) << _shifts()).sum(dim=-1)
        out[r0:r0 + _ROWS_PER_STEP] = torch.where(words >= 2**31, words - 2**32, words)  # same 32 bits, signed
    return out


def unpack_int32_words(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """int32 [R, W] -> int8 codes -8..7 [R, cols] (cols <= 8 W: a padded last word is cut)."""
    import torch

    if sys.byteorder == "little":  # a word's byte k holds nibbles 2k (low) and 2k + 1: a byte a value, no int64
        codes = unpack_nibble_pairs(packed.contiguous().view(torch.uint8))
        return codes if codes.shape[1] == cols else codes[:, :cols].contiguous()
    words = packed.to(torch.int64) & 0xFFFFFFFF  # treat as unsigned 32-bit
    nibbles = (words.unsqueeze(-1) >> _shifts()) & 0xF  # [R, W, 8], low nibble first
    return (nibbles.reshape(packed.shape[0], -1)[:, :cols] - 8).to(torch.int8)
