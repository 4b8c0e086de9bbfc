"""MXFP4 decoding (quant/fp4_e2m1.dequantize_fp4): on the CPU each code pair byte is looked up in a table; every value
must be the code's E2M1 value times 2^(scale byte - 127), as plain arithmetic states it, bit for bit, in every dtype
asked, at every scale byte (255, e8m0's NaN, included: the readers refuse it first, the decoder still agrees)."""

from __future__ import annotations

import pytest
import torch

from kconvert.quant.fp4_e2m1 import E2M1, dequantize_fp4


def _reference(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    lut = torch.tensor(E2M1 + tuple(-v for v in E2M1), dtype=torch.float32)
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).long()
    k = scale.view(torch.uint8).to(torch.float32) - 127
    return lut[codes] * torch.exp2(k).repeat_interleave(32, dim=-1)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float16])
def test_every_value_is_the_code_times_its_scale(seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    rows, cols = [(7, 64), (130, 256), (1, 32), (64, 1024)][seed]
    packed = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=gen)
    scale = torch.randint(0, 256, (rows, cols // 32), dtype=torch.uint8, generator=gen).view(torch.float8_e8m0fnu)
    got, want = dequantize_fp4(packed, scale, dtype), _reference(packed, scale).to(dtype or torch.float32)
    assert got.dtype == want.dtype and got.shape == (rows, cols)
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[want.dtype.itemsize]
    assert torch.equal(got.view(bits), want.view(bits))
