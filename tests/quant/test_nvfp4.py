"""kconvert/quant/nvfp4.py against arithmetic written here and against compressed-tensors' own NVFP4 decompressor (an
independent decoder of the bytes): ModelOpt's amax rule, the exact MXFP4 cast and its counts (a block forced out of
e4m3's window is counted and rounded at the data-derived scale), the shared scale of a fused pair, and each refusal of
bad NVFP4 input in one line naming the tensor."""

from __future__ import annotations

import os

import pytest
import torch

from kconvert.quant import nvfp4
from kconvert.quant.fp4_e2m1 import quantize_fp4
from kconvert.quant.scheme import COMPRESSED_TENSORS, KCONVERT, Options
from kconvert.quant.tally import counting

GRID = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float64)


def _seed() -> tuple[int, torch.Generator]:
    seed = int.from_bytes(os.urandom(4), "little")
    return seed, torch.Generator().manual_seed(seed)


def _nearest(y: torch.Tensor) -> torch.Tensor:
    """float64 y -> the nearest signed e2m1 value, a tie to the even code (brute force over the grid)."""
    dist = (y.abs().unsqueeze(-1) - GRID).abs()
    tied = dist == dist.min(-1, keepdim=True).values
    return GRID[((~tied) * 10 + torch.arange(8) % 2).argmin(-1)] * torch.sign(y)


def _values(packed: torch.Tensor, block: torch.Tensor, per_block: torch.Tensor) -> torch.Tensor:
    """Code pairs (even column low, sign bit 3) times each 16-block's float64 factor."""
    q = packed.to(torch.int16)
    codes = torch.stack([q & 0xF, q >> 4], -1).view(q.shape[0], -1)
    mag = GRID[(codes & 7).long()] * (1 - 2 * (codes >> 3)).double()
    return mag * per_block.repeat_interleave(16, dim=1)


def test_amax_rule_is_modelopts_with_nearest_e2m1_values_ties_to_even():
    """scale_2 = amax / 2688 (float32), block scale e4m3(max(block amax / (6 scale_2), 2^-9)) (1 for an all-zero
    block), every value the nearest e2m1 of w / (scale * scale_2) (ties to even); midpoints and all-zero rows in."""
    seed, g = _seed()
    w = torch.randn(40, 256, generator=g) * torch.logspace(-3, 1, 40)[:, None]
    w[3] = 0.0
    w[4, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2) * torch.tensor([1.0] * 8 + [-1.0] * 8)
    packed, block, s2 = nvfp4.quantize_nvfp4(w, name="x.weight")
    assert float(s2) == float(torch.tensor(float(w.abs().max()), dtype=torch.float32) / 2688.0), seed
    bamax = w.view(40, 16, 16).abs().amax(-1)
    want_block = (bamax / (6 * s2)).where(bamax > 0, torch.ones(())).clamp(min=2.0 ** -9).to(torch.float8_e4m3fn)
    assert torch.equal(block.view(torch.uint8), want_block.view(torch.uint8)), seed
    divisor = (block.to(torch.float32) * s2).double()  # ModelOpt divides by the float32 product
    want = _nearest(w.double().view(40, 16, 16) / divisor[..., None]).view(40, 256)
    got = _values(packed, block, torch.ones_like(divisor))
    assert torch.equal(got, want), seed
    assert torch.equal(nvfp4.dequantize_nvfp4(packed, block, s2)[3], torch.zeros(256))
    # a value that rounds to zero keeps its sign bit (ModelOpt's and compressed-tensors' packers): code 8 when negative
    codes = torch.stack([packed & 0xF, packed >> 4], -1).view(40, 256)
    zero = want == 0
    assert torch.equal(codes[zero & (w < 0)], torch.full_like(codes[zero & (w < 0)], 8)), seed
    assert bool((codes[zero & (w >= 0)] == 0).all()) and bool((zero & (w < 0)).any()), seed


def _mxfp4(g: torch.Generator, rows: int, cols: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4: code pairs and e8m0 exponents in [lo, hi] (the top one in a live group)."""
    packed = torch.randint(0, 256, (rows, cols // 2), generator=g, dtype=torch.uint8)
    k = torch.randint(lo, hi + 1, (rows, cols // 32), generator=g)
    k[0, 0] = hi
    packed[0, :16] |= 0x07  # group (0, 0) live at the top exponent
    return packed, (k + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def test_mxfp4_cast_keeps_every_code_and_value_within_the_window():
    from kconvert.quant.fp4_e2m1 import dequantize_fp4

    seed, g = _seed()
    packed, e8m0 = _mxfp4(g, 48, 256, -20, -20 + nvfp4.WINDOW)  # k_max - k_j <= 17 everywhere
    with counting() as tally:
        out, block, s2 = nvfp4.cast_mxfp4(packed, e8m0, name="x.weight")
    assert torch.equal(out, packed), seed  # every nibble verbatim
    assert float(s2) == 2.0 ** (-20 + nvfp4.WINDOW - 8)
    assert tally == [48 * 256 // 16, 0]
    assert torch.equal(nvfp4.dequantize_nvfp4(out, block, s2), dequantize_fp4(packed, e8m0)), seed
    k = e8m0.view(torch.uint8).to(torch.int64).repeat_interleave(2, 1) - 127
    assert torch.equal(block.to(torch.float64), 2.0 ** (k - (-20 + nvfp4.WINDOW - 8)).double()), seed


def test_a_block_forced_out_of_the_window_is_counted_and_rounded_at_the_data_derived_scale():
    """A group 20 octaves below k_max: its two 16-blocks take the finest e4m3 scale 2^-9 and their values go to the
    nearest e2m1 at 2^-9 * scale_2; every other block stays exact and is counted so."""
    from kconvert.quant.fp4_e2m1 import dequantize_fp4

    seed, g = _seed()
    packed, e8m0 = _mxfp4(g, 8, 64, 0, 4)
    k = e8m0.view(torch.uint8).clone()
    k[5, 1] = 127 + 4 - 20  # far below k_max = 4
    packed[5, 16:32] = torch.randint(1, 256, (16,), generator=g, dtype=torch.uint8) | 0x11  # live codes
    e8m0 = k.view(torch.float8_e8m0fnu)
    with counting() as tally:
        out, block, s2 = nvfp4.cast_mxfp4(packed, e8m0, name="x.weight")
    assert tally == [8 * 64 // 16 - 2, 2], seed
    src = dequantize_fp4(packed, e8m0).double()
    got = nvfp4.dequantize_nvfp4(out, block, s2).double()
    outside = torch.zeros(8, 64, dtype=torch.bool)
    outside[5, 32:64] = True
    assert torch.equal(got[~outside], src[~outside]), seed
    step = 2.0 ** -9 * float(s2)
    assert torch.equal(got[outside], _nearest(src[outside] / step) * step), seed
    assert torch.equal(block.view(torch.uint8)[5, 2:4], torch.tensor([1, 1], dtype=torch.uint8))  # e4m3 2^-9


def test_a_fused_pair_shares_the_larger_scale_and_stays_exact():
    """w1 / w3 with different k_max: both cast with the larger one's scale_2 keep every value (their blocks stay
    within the window), so engines can fuse them into one GEMM."""
    from kconvert.quant.fp4_e2m1 import dequantize_fp4

    seed, g = _seed()
    w1, w3 = _mxfp4(g, 16, 128, -4, 2), _mxfp4(g, 16, 128, -9, -1)
    scheme = nvfp4.SCHEME
    copy = scheme.lossless_copy(type("S", (), {"format": "fp4_packed", "parts": ()})(), Options())
    shared = max(scheme.tensor_scale(w, copy) for w in (w1, w3))
    assert shared == 2.0 ** (2 - 8)
    for packed, e8m0 in (w1, w3):
        stored = copy.recode((packed, e8m0), "x", Options(tensor_scale=shared))
        assert float(stored[2]) == shared
        assert torch.equal(scheme.dequantize(stored, Options()), dequantize_fp4(packed, e8m0)), seed


@pytest.mark.parametrize("source", ["bf16", "mxfp4"])
def test_compressed_tensors_decompressor_decodes_our_bytes_bit_for_bit(source):
    """compressed-tensors' NVFP4PackedCompressor (its NVFP4 preset scheme) decodes the nvfp4-ct encoding to exactly
    our dequantization (bf16, as it returns it); its own unpacker and dequantize at float32 too. ModelOpt's encoding
    of the same codes decodes to the same values where scale_2 is a power of two (the exact cast)."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from compressed_tensors.quantization.quant_scheme import NVFP4

    seed, g = _seed()
    ct, mo = Options(encoding=COMPRESSED_TENSORS), Options(encoding=KCONVERT)
    w = torch.randn(64, 192, generator=g) * 0.03
    if source == "bf16":
        stored = nvfp4.SCHEME.quantize(w.to(torch.bfloat16), ct, "x.weight")
    else:
        copy = nvfp4.SCHEME.lossless_copy(type("S", (), {"format": "fp4_packed", "parts": ()})(), ct)
        mx = quantize_fp4(w)
        stored = copy.recode(mx, "x.weight", ct)
        assert torch.equal(nvfp4.SCHEME.dequantize(copy.recode(mx, "x.weight", mo), mo),
                           nvfp4.SCHEME.dequantize(stored, ct)), seed
    packed, block, global_scale, input_global = stored
    scheme = QuantizationScheme(targets=["Linear"], **NVFP4)
    out = NVFP4PackedCompressor.decompress({"weight_packed": packed, "weight_scale": block,
                                            "weight_global_scale": global_scale}, scheme)["weight"]
    ours = nvfp4.SCHEME.dequantize(stored, ct, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(out, ours), seed
    codes = unpack_fp4_from_uint8(packed, 64, 192, dtype=torch.float32)
    f32 = dequantize(codes, block.to(torch.float32), args=QuantizationArgs(**NVFP4["weights"].model_dump()),
                     dtype=torch.float32, global_scale=global_scale)
    assert torch.equal(f32, nvfp4.SCHEME.dequantize(stored, ct)), seed
    assert float(input_global) == 1.0 / nvfp4.INPUT_SCALE


def test_scheme_options_and_shapes():
    s = nvfp4.SCHEME
    assert s.option_problem(Options(group_size=64)) and not s.option_problem(Options(group_size=16))
    assert s.misfit((8, 40), Options()) and not s.misfit((8, 48), Options())
    assert [n for n, _, _ in s.specs("a.w.weight", (8, 32), Options())] == \
        ["a.w.weight", "a.w.weight_scale", "a.w.weight_scale_2", "a.w.input_scale"]
    assert [n for n, _, _ in s.specs("a.w.weight", (8, 32), Options(encoding=COMPRESSED_TENSORS))] == \
        ["a.w.weight_packed", "a.w.weight_scale", "a.w.weight_global_scale", "a.w.input_global_scale"]
    assert s.stored_bytes((8, 32), Options()) == 8 * 16 + 8 * 2 + 4 + 4
    with pytest.raises(Exception, match="NaN/Inf"):
        nvfp4.quantize_nvfp4(torch.tensor([[float("nan")] + [0.0] * 15]), name="x.weight")


def test_the_faithfulness_reference_gives_our_values_on_bf16_ties():
    """verify's independent NVFP4 reference (compressed-tensors' FP4 rounding, ModelOpt's scales and divisor) holds
    kconvert's bytes exactly, on bf16 weights whose quotients land on e2m1 midpoints (2.5 at a block scale of 256
    times the fused pair's scale_2): a reference dividing by compressed-tensors' scale / global_scale breaks such ties
    the other way (measured: faithfulness 2.6e-5 on tiny-dsv4-trained)."""
    from kconvert.verify.fake_quant_nvfp4 import nvfp4_qdq

    seed, g = _seed()
    pair_amax = 0.287109375  # the partner's (w3's) amax: this tensor's own is smaller
    w = (torch.randn(32, 64, generator=g) * 0.05).to(torch.bfloat16).float()
    w[0, :16] = 0.0
    w[0, 0], w[0, 5], w[0, 9] = 0.1640625, -0.068359375, 0.068359375  # block scale 256: -0.0684 / 0.02734 = -2.5
    stored = nvfp4.quantize_nvfp4(w, nvfp4.scale_from_amax(pair_amax))
    ours = nvfp4.dequantize_nvfp4(*stored)
    assert float(ours[0, 5]) == -0.0546875  # the tie went to the even code (2), as ModelOpt's packer sends it
    assert torch.equal(nvfp4_qdq(w, pair_amax), ours), seed
    assert torch.equal(nvfp4_qdq(w), nvfp4.dequantize_nvfp4(*nvfp4.quantize_nvfp4(w))), seed
