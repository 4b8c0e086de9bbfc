"""GPTQ (kconvert/quant/gptq.py) against a straightforward implementation of the same rule (the optimal brain
quantizer's explicit inverse-Hessian update, no Cholesky, no blocks), on fresh random weights and correlated
inputs; that it beats rounding to nearest where it matters (the layer's output); and that compressed-tensors'
own decompressor reads its codes and static scales on both grids."""

from __future__ import annotations

import os

import pytest
import torch

from kconvert.quant.gptq import GRIDS, Hessian, gptq_codes, gptq_quantize, group_scales
from kconvert.quant.packing import pack_int32_words


def _case(seed: int, rows: int, cols: int, tokens: int):
    """Weights with an outlier and inputs with correlated features of very different sizes (as activations)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.02
    w[1, 3] = 0.3
    mix = torch.randn(cols, cols, generator=g) / cols ** 0.5 + torch.eye(cols)
    x = (torch.randn(tokens, cols, generator=g) @ mix) * torch.linspace(0.2, 3.0, cols)[torch.randperm(cols, generator=g)]
    return w, x


def _reference_codes(w, H, scale, group, grid, damp=0.01):
    """Column by column in decreasing-diagonal order: quantize, spread the error over every other column by
    the current inverse Hessian, remove the column from the inverse (float64 throughout)."""
    W = w.double().clone()
    H = H.double().clone()
    d = H.diagonal()
    d[d <= 0] = 1.0
    Hinv = torch.linalg.inv(H + damp * float(d.mean()) * torch.eye(H.shape[0], dtype=torch.float64))
    S = scale.double().repeat_interleave(group, 1)
    Q = torch.zeros_like(W)
    for j in torch.argsort(H.diagonal(), descending=True, stable=True).tolist():
        q = torch.clamp(torch.round(W[:, j] / S[:, j]), grid.qmin, grid.qmax)
        Q[:, j] = q
        err = (W[:, j] - q * S[:, j]) / Hinv[j, j]
        W -= err[:, None] * Hinv[j][None, :]
        Hinv = Hinv - Hinv[:, j:j + 1] @ Hinv[j:j + 1, :] / Hinv[j, j]
    return Q.to(torch.int8)


def _out_err(w, q, x):
    return float((x @ (w - q).T).pow(2).sum())


@pytest.mark.parametrize("grid", sorted(GRIDS))
def test_gptq_matches_the_straightforward_rule(grid):
    seed = int.from_bytes(os.urandom(4), "little")
    rows, cols, group = 24, 96, 32
    w, x = _case(seed, rows, cols, 300)
    g = GRIDS[grid]
    h = Hessian(cols)
    h.add(x[:170])
    h.add(x[170:])  # accumulated in parts = at once
    assert h.tokens == 300 and torch.allclose(h.sum, x.T @ x, rtol=1e-4, atol=1e-3)
    codes, scale = gptq_quantize(w, h.sum, group, g)
    assert torch.equal(scale, group_scales(w, group, g))  # static: the scales of the original weight
    ref = _reference_codes(w, h.sum, scale, group, g)
    same = float((codes == ref).float().mean())
    assert same > 0.99, (seed, same)  # near-ties may round the other way in float32
    assert int(codes.min()) >= g.qmin and int(codes.max()) <= g.qmax
    deq = codes.float() * scale.float().repeat_interleave(group, 1)
    ref_deq = ref.float() * scale.float().repeat_interleave(group, 1)
    assert _out_err(w, deq, x) < 1.02 * _out_err(w, ref_deq, x), seed
    # blocks of any width give the same codes (the lazy update is exact)
    assert float((gptq_codes(w, h.sum, scale, group, g, block=40) == codes).float().mean()) > 0.99


def test_gptq_beats_round_to_nearest_on_the_output():
    seed = int.from_bytes(os.urandom(4), "little")
    w, x = _case(seed, 48, 128, 400)
    for g in GRIDS.values():
        codes, scale = gptq_quantize(w, x.T @ x, 32, g)
        rtn, _ = gptq_quantize(w, None, 32, g)
        S = scale.float().repeat_interleave(32, 1)
        assert _out_err(w, codes * S, x) < 0.7 * _out_err(w, rtn * S, x), (seed, g.name)


def test_untouched_columns_and_no_tokens_round_to_nearest():
    w, x = _case(3, 16, 64, 200)
    g = GRIDS["minmax"]
    rtn, scale = gptq_quantize(w, None, 32, g)
    assert torch.equal(rtn, gptq_codes(w, torch.zeros(64, 64), scale, 32, g))  # H = 0: nothing to feed back
    x[:, 5] = 0.0  # an input no token uses: its column keeps its nearest code, the others still calibrate
    codes, _ = gptq_quantize(w, x.T @ x, 32, g)
    assert torch.equal(codes[:, 5], rtn[:, 5])


@pytest.mark.parametrize("grid", ["minmax", "kimi"])
def test_compressed_tensors_decompressor_reads_gptq_output(grid):
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    w, x = _case(5, 16, 64, 200)
    codes, scale = gptq_quantize(w, x.T @ x, 32, GRIDS[grid])
    stored = {"weight_packed": pack_int32_words(codes), "weight_scale": scale,
              "weight_shape": torch.tensor([16, 64], dtype=torch.int32)}
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=32))
    theirs = BaseCompressor.load_from_registry("pack-quantized").decompress(stored, scheme)["weight"]
    assert torch.equal(theirs.float(), (codes.float() * scale.float().repeat_interleave(32, 1)).to(theirs.dtype).float())
    if grid == "kimi":
        assert int(codes.min()) >= -7  # 15 levels: -8 never used


# ---- NVFP4: e2m1 values at the uncalibrated path's scales (shard's own encoder, quant/nvfp4.py, is the reference)
E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float64)


def _nearest_e2m1(y: torch.Tensor) -> torch.Tensor:
    """float64 y -> the nearest signed e2m1 value (saturating at 6), a tie to the even code: brute force."""
    dist = (y.abs().unsqueeze(-1) - E2M1).abs()
    tied = dist == dist.min(-1, keepdim=True).values
    return E2M1[((~tied) * 10 + torch.arange(8) % 2).argmin(-1)] * torch.sign(y)


def _reference_nvfp4(w, H, per_block, damp=0.01):
    """_reference_codes' explicit inverse-Hessian rule with each column rounded to the nearest e2m1 value at its
    16-block's scale: the e2m1 value of each weight (float64; times its scale, the weight)."""
    W = w.double().clone()
    H = H.double().clone()
    d = H.diagonal()
    d[d <= 0] = 1.0
    Hinv = torch.linalg.inv(H + damp * float(d.mean()) * torch.eye(H.shape[0], dtype=torch.float64))
    S = per_block.double().repeat_interleave(16, 1)
    Q = torch.zeros_like(W)
    for j in torch.argsort(H.diagonal(), descending=True, stable=True).tolist():
        Q[:, j] = _nearest_e2m1(W[:, j] / S[:, j])
        err = (W[:, j] - Q[:, j] * S[:, j]) / Hinv[j, j]
        W -= err[:, None] * Hinv[j][None, :]
        Hinv = Hinv - Hinv[:, j:j + 1] @ Hinv[j:j + 1, :] / Hinv[j, j]
    return Q


def test_nvfp4_gptq_keeps_the_uncalibrated_scales_and_beats_round_to_nearest():
    """Block scales and weight_scale_2 are the uncalibrated encoder's (a fused pair's given scale_2 too); the codes
    follow the explicit rule and cut the layer's output error well below round-to-nearest's; with uncorrelated
    inputs (H = identity) nothing flows between columns and the bytes are round-to-nearest's, bit for bit."""
    from kconvert.quant.gptq import NVFP4
    from kconvert.quant.nvfp4 import dequantize_nvfp4, pack, quantize_nvfp4

    seed = int.from_bytes(os.urandom(4), "little")
    w, x = _case(seed, 24, 128, 400)
    w[5, 40:56] *= 1e-3  # a block far below the tensor's largest: its own fine e4m3 scale
    H = x.T @ x
    codes, block, s2 = NVFP4.gptq(w, H, name="w")
    packed, rtn_block, rtn_s2 = quantize_nvfp4(w)
    assert torch.equal(block.view(torch.uint8), rtn_block.view(torch.uint8)) and float(s2) == float(rtn_s2), seed
    deq = dequantize_nvfp4(pack(codes), block, s2)
    assert torch.equal(deq, NVFP4.dequantize((codes, block, s2)))
    per_block = block.float() * s2
    ref = _reference_nvfp4(w, H, per_block)
    c = codes.long()
    mag = E2M1[c & 7] * (1 - 2 * (c >> 3)).double()
    assert float((mag == ref).float().mean()) > 0.99, seed  # near-ties may round the other way in float32
    rtn = dequantize_nvfp4(packed, rtn_block, rtn_s2)
    assert _out_err(w, deq, x) < 1.02 * _out_err(w, ref.float() * per_block.repeat_interleave(16, 1), x), seed
    assert _out_err(w, deq, x) < 0.8 * _out_err(w, rtn, x), seed
    eye, _, _ = NVFP4.gptq(w, torch.eye(128), name="w")
    assert torch.equal(pack(eye), packed), seed
    none, _, _ = NVFP4.gptq(w, None, name="w")  # no calibration tokens: the same nearest codes
    assert torch.equal(pack(none), packed), seed
    shared = float(rtn_s2) * 1.7  # a fused partner's larger amax: every block scale from it, as shard's encoder
    codes2, block2, s2b = NVFP4.gptq(w, torch.eye(128), scale_2=shared, name="w")
    p2, b2, _ = quantize_nvfp4(w, shared)
    assert float(s2b) == float(torch.tensor(shared, dtype=torch.float32)) and torch.equal(pack(codes2), p2)
    assert torch.equal(block2.view(torch.uint8), b2.view(torch.uint8)), seed
