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
