"""FP4 e2m1 experts (e8m0 per 32) re-encoded as block FP8 (e4m3 + one power-of-two scale per 128x128):
every code at every scale exponent comes back bit-exact, and a block whose groups span more than one FP8
scale can hold is refused with the reason, never rounded. The expected values are computed here by plain
arithmetic (code table times 2^(byte - 127)), not by kconvert's FP4 reader."""

from __future__ import annotations

import pytest
import torch

from kconvert.errors import UsageError
from kconvert.quant.fp4_to_fp8 import SPAN, fp4_to_fp8_block

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def plain_value(code: int, byte: int) -> float:
    mag = E2M1[code & 7] * 2.0 ** (byte - 127)
    return -mag if code & 8 else mag


def fp8_value(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    rows, cols = q.shape
    per = s.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
    return q.to(torch.float64) * per.to(torch.float64)


def block_of(codes: torch.Tensor, bytes_: torch.Tensor):
    """codes [R, C] (0..15), scale bytes [R, C/32] -> (packed uint8 pairs, e8m0 scales)."""
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    return packed, bytes_.to(torch.uint8).view(torch.float8_e8m0fnu)


@pytest.mark.parametrize("top", [0, 1, 20, 127, 141, 200, 254])
def test_every_code_at_every_exponent_in_a_block_is_exact(top):
    # one 128x128 block: 128 rows x 4 groups; the group exponents cover the whole span the block can hold,
    # every one of the 16 codes appears in every group (the negative zero code 8 included)
    lo = max(0, top - SPAN)
    exps = torch.arange(128 * 4) % (top - lo + 1) + lo
    codes = (torch.arange(128 * 128) % 16).view(128, 128)
    packed, scale = block_of(codes, exps.view(128, 4))
    q, s = fp4_to_fp8_block(packed, scale)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (1, 1)
    assert float(s) == 2.0 ** (top - 127 - 6)  # a power of two, valid as fp32 or ue8m0
    want = torch.tensor([[plain_value(int(codes[r, c]), int(exps[r * 4 + c // 32])) for c in range(128)]
                         for r in range(128)], dtype=torch.float64)
    assert torch.equal(fp8_value(q, s), want)


def test_ragged_shapes_and_empty_groups():
    gen = torch.Generator().manual_seed(11)
    rows, cols = 200, 320  # partial blocks in both dimensions
    codes = torch.randint(0, 16, (rows, cols), generator=gen)
    exps = torch.randint(100, 110, (rows, cols // 32), generator=gen)
    codes[:, 32:64] = 0  # an all-zero group: its (extreme) scale carries no value and does not count
    exps[:, 1] = 254
    packed, scale = block_of(codes, exps)
    q, s = fp4_to_fp8_block(packed, scale)
    assert s.shape == (2, 3)
    want = torch.tensor([[plain_value(int(codes[r, c]), int(exps[r, c // 32])) for c in range(cols)]
                         for r in range(rows)], dtype=torch.float64)
    assert torch.equal(fp8_value(q, s), want)


def test_a_block_wider_than_one_scale_is_refused_with_the_reason():
    codes = torch.full((128, 128), 1)  # 0.5 everywhere
    exps = torch.full((128, 4), 120)
    exps[3, 2] = 120 + SPAN + 1
    packed, scale = block_of(codes, exps)
    with pytest.raises(UsageError, match=r"more than the 14 octaves.*--requantize") as e:
        fp4_to_fp8_block(packed, scale, "layers.0.ffn.experts.3.w1.weight")
    assert e.value.tensor == "layers.0.ffn.experts.3.w1.weight"
    exps[3, 2] = 120 + SPAN  # the widest span a block holds
    q, s = fp4_to_fp8_block(*block_of(codes, exps))
    assert float(q.to(torch.float32).abs().min()) == 2.0 ** -9  # the smallest value lands on e4m3's last subnormal


def nearest_e4m3(v: float) -> float:
    """The e4m3fn value nearest v (ties to the even code), from a table built by plain arithmetic."""
    table = []
    for b in range(0x7F):  # the positive finite codes (0x7F is NaN)
        e, m = b >> 3, b & 7
        table.append((m * 2.0 ** -9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7), b))
    mag, b = min(table, key=lambda t: (abs(t[0] - abs(v)), t[1] & 1))
    return -mag if v < 0 else mag


def test_requantize_rounds_only_the_groups_one_scale_cannot_hold():
    """Issue 42, class 4: `--requantize` promised rounding for a block spanning more than 14 octaves but still
    refused it. With rounding the block's scale holds its largest group exactly; the groups below the span are
    rounded to the nearest e4m3 value (subnormals, or zero), the rest stay exact."""
    gen = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 16, (128, 128), generator=gen)
    exps = torch.full((128, 4), 130)
    exps[0, 0], exps[1, 1], exps[2, 2] = 130 - SPAN - 1, 130 - SPAN - 3, 130 - 40  # rounded, coarser, zero
    packed, scale = block_of(codes, exps)
    with pytest.raises(UsageError, match="--requantize"):
        fp4_to_fp8_block(packed, scale)
    q, s = fp4_to_fp8_block(packed, scale, rounding=True)
    assert float(s) == 2.0 ** (130 - 127 - 6)
    got = fp8_value(q, s)
    for r in range(128):
        for c in range(128):
            want = plain_value(int(codes[r, c]), int(exps[r, c // 32]))
            assert float(got[r, c]) == nearest_e4m3(want / float(s)) * float(s), (r, c, want)
    assert bool((q[2, 64:96].to(torch.float32) == 0).all())  # 40 octaves down: nothing left
    assert not torch.equal(got[0, :32], torch.tensor([plain_value(int(codes[0, c]), int(exps[0, 0])) for c in range(32)],
                                                     dtype=torch.float64))  # something was indeed rounded


@pytest.mark.parametrize("seed", range(6))
def test_the_pair_table_gives_the_products_bits(seed):
    """fp4_to_fp8_block looks each code pair up in a table of e4m3 bytes: the same bits as casting code x 2^(k - m)
    computed in float32, for stacks, odd row counts, every block size, exact and rounding (--requantize)."""
    from kconvert.quant.fp4_e2m1 import E2M1, E8M0_BIAS
    from kconvert.quant.fp4_to_fp8 import block_exponents

    gen = torch.Generator().manual_seed(seed)
    lead, rows, cols = [(), (3,), (2, 2)][seed % 3], [130, 7, 256][seed % 3], [96, 256][seed % 2]
    packed = torch.randint(0, 256, (*lead, rows, cols // 2), dtype=torch.uint8, generator=gen)
    lut = torch.tensor(E2M1 + tuple(-v for v in E2M1), dtype=torch.float32)
    for block, rounding, spread in ((128, True, 30), (64, True, 30), (128, False, 12), (32, False, 12)):
        exps = torch.randint(120 - spread // 2, 120 + spread // 2, (*lead, rows, cols // 32), generator=gen)
        scale = exps.to(torch.uint8).view(torch.float8_e8m0fnu)
        m = block_exponents(packed, scale, "", block, rounding)
        m_groups = m.repeat_interleave(block, -2)[..., :rows, :].repeat_interleave(block // 32, -1)[..., :cols // 32]
        d = (exps - E8M0_BIAS - m_groups).clamp(-16 if rounding else -8, 6)
        codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).long()
        want = (lut[codes] * torch.exp2(d.float()).repeat_interleave(32, dim=-1)).to(torch.float8_e4m3fn)
        q, s = fp4_to_fp8_block(packed, scale, "", block, rounding)
        assert torch.equal(q.view(torch.uint8), want.view(torch.uint8)) and torch.equal(s, torch.exp2(m.float()))
