"""kconvert/quant: every registered scheme stores what its specs say, dequantizes by the formula
(checked against plain arithmetic written here), and shard and export count what they read alike."""

from __future__ import annotations

import os

import pytest
import torch

from kconvert.io.dtypes import DTYPES
from kconvert.quant.registry import REGISTRY, SHARD_SCHEMES
from kconvert.quant.scheme import COMPRESSED_TENSORS, KCONVERT, Options

# int4 and nvfp4 lay their values out per encoding; every other scheme stores the same either way
CASES = [(name, KCONVERT) for name in REGISTRY] + [("int4", COMPRESSED_TENSORS), ("nvfp4", COMPRESSED_TENSORS)]


def _by_hand(name: str, enc: str, stored: list[torch.Tensor], group: int, cols: int) -> torch.Tensor:
    """The stored tensors back to float32, element by element as docs/FORMAT.md and docs/EXPORT.md say."""
    q, s = stored[0], stored[1].float()
    rows = q.shape[0]
    if name == "fp8":
        return q.float() * s[torch.arange(rows)[:, None] // 128, torch.arange(cols)[None, :] // 128]
    if name in ("int8", "fp8_channel"):
        return q.float() * s
    if name == "fp4":  # two e2m1 codes a byte (even column low): sign bit 3, magnitude bits 0-2; scale 2^(e-127)
        codes = torch.stack([(q.to(torch.int16) & 0xF), (q.to(torch.int16) >> 4)], -1).view(rows, -1)
        mag = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])[(codes & 7).long()] * (1 - 2 * (codes >> 3))
        e = stored[1].view(torch.uint8).double() - 127
        return (mag.double() * (2.0 ** e)[:, torch.arange(cols) // 32]).float()
    if name == "nvfp4":  # e2m1 codes as fp4's; each 16-block's e4m3 scale times the tensor's (ModelOpt: times
        # weight_scale_2, the scales' product first; compressed-tensors: over weight_global_scale)
        codes = torch.stack([(q.to(torch.int16) & 0xF), (q.to(torch.int16) >> 4)], -1).view(rows, -1)
        mag = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])[(codes & 7).long()] * (1 - 2 * (codes >> 3))
        t = stored[2].float().reshape(())
        per = (s * t if enc == KCONVERT else s / t)[:, torch.arange(cols) // 16]
        return mag * per
    if name == "fp8_rows":  # e4m3 values, one scale 2^(e-127) per 32 values of a row (V4.1's Engram tables)
        e = stored[1].view(torch.uint8).double() - 127
        return (q.double() * (2.0 ** e)[:, torch.arange(cols) // 32]).float()
    if enc == KCONVERT:  # two nibbles a byte, even column low
        codes = torch.stack([(q.to(torch.int16) & 0xF), (q.to(torch.int16) >> 4)], -1).view(rows, -1) - 8
    else:  # eight nibbles an int32 word, low nibble first
        w = q.to(torch.int64) & 0xFFFFFFFF
        codes = torch.stack([(w >> (4 * k)) & 0xF for k in range(8)], -1).view(rows, -1) - 8
    return codes.float() * s[:, torch.arange(cols) // group]


@pytest.mark.parametrize("name,enc", CASES)
def test_scheme_stores_its_specs_and_dequantizes_by_the_formula(name, enc):
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    scheme = REGISTRY[name]
    for shape, group in (((200, 320), 32), ((130, 64), 64)):
        w = torch.randn(*shape, generator=g) * 0.05
        w[2] = 0.0  # an all-zero row (and groups and blocks)
        opts = Options("fp32", group, "amax", enc)
        stored = scheme.quantize(w.to(torch.bfloat16), opts, "x.weight")
        specs = scheme.specs("x.weight", shape, opts)
        assert [(t.dtype, tuple(t.shape)) for t in stored] == [(DTYPES[tag], s) for _, tag, s in specs], (name, enc)
        assert scheme.stored_bytes(shape, opts) == sum(t.numel() * t.element_size() for t in stored)
        deq = scheme.dequantize(stored, opts)
        assert torch.equal(deq, _by_hand(name, enc, stored, group, shape[1])), (name, enc, seed)
        assert torch.equal(deq[2], torch.zeros(shape[1]))
        # within a step of the weight: the scale of each value's block / row / group times 0.5 (int4 with
        # clipping and compressed-tensors' +7.5 rounding: one step; e4m3: 1/16 of the value's power of two)
        ref = w.to(torch.bfloat16).float()
        err = (deq - ref).abs().max().item()
        # fp4: half of 6's spacing 2 at scale amax/6*2; nvfp4: half that spacing at the block's amax/6 (its e4m3
        # scale rounded up by at most 1/16)
        step = {"int4": 7.0, "int8": 127.0, "fp4": 3.0, "nvfp4": 5.0}.get(name, 8.0)
        assert err <= ref.abs().max().item() / step, (name, enc, seed)


def test_schemes_listed_once():
    from cli.shard_cmd import shard
    from kconvert.disk_format.catalog import SCHEMES as catalog_schemes
    from kconvert.quant.policy import SCHEMES as policy_schemes

    assert catalog_schemes == policy_schemes == SHARD_SCHEMES == ("none", "fp8", "int8", "int4", "fp4", "nvfp4")
    quant = next(p for p in shard.params if p.name == "quant")
    assert tuple(quant.type.choices) == SHARD_SCHEMES


def test_shard_and_export_count_an_int4_source_by_its_stored_bytes(checkpoint, tmp_path):
    """Both planners count what they read as the source stores it: packed INT4 is half a byte a value
    (shard once counted a byte, so it reported twice the bytes read and GB/s of an INT4 release)."""
    from kconvert.convert.export.job import ExportJob, plan_export
    from kconvert.convert.layout import Layout
    from kconvert.quant.policy import QuantPolicy
    from kconvert.convert.shard.plan import plan_items
    from kconvert.source.checkpoint import Checkpoint

    ck = Checkpoint.open(checkpoint("tiny-k25-dsv32-int4"))
    stored = sum(t.main.nbytes for t in ck.logical.values())
    assert any(t.format == "int4_packed" for t in ck.logical.values())
    for quant in ("none", "int4", "fp8"):
        items = plan_items(ck, Layout.make(1, 1), QuantPolicy(quant), keep_mtp=True)
        assert sum(w.bytes_in for w in items) == stored, quant
    for fmt in ("w4a16", "fp8-block"):
        files = plan_export(ck, ExportJob(str(ck.root), str(tmp_path / fmt), fmt), "fp32")
        assert sum(e.bytes_in for f in files for e in f) == stored, fmt


def test_fp4_codes_are_the_nearest_e2m1_value_ties_to_even_and_scales_powers_of_two():
    """fp4 (MXFP4, DeepSeek-V4's experts) against a brute force in float64: the scale is the least power of
    two putting the group's amax at or under 6, every value goes to the nearest of the 15 signed e2m1
    values times it, a tie to the even code; exact midpoints and all 16 codes are in the input."""
    from kconvert.quant.fp4_e2m1 import quantize_fp4

    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float64)
    w = torch.randn(48, 256, generator=g, dtype=torch.float64) * torch.logspace(-6, 2, 48, dtype=torch.float64)[:, None]
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.0], dtype=torch.float64)
    w[0, :18] = torch.cat([mids, -mids]) * 2.0 ** -3  # amax 0.75 = 6 * 2^-3: the midpoints land exactly
    w[1] = 0.0
    w = w.float()
    packed, scale = quantize_fp4(w, "x.weight")
    deq = REGISTRY["fp4"].dequantize([packed, scale], Options())
    x = w.double().view(48, 8, 32)
    amax = x.abs().amax(-1, keepdim=True)
    e = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6)), torch.full_like(amax, -127.0))
    assert torch.equal(scale.view(torch.uint8).view(48, 8, 1).double() - 127, e), seed
    y = (x / 2.0 ** e).abs()
    dist = (y.unsqueeze(-1) - grid).abs()
    best = dist.min(-1, keepdim=True).values
    tied = (dist == best)
    # nearest; on a tie the even index (mantissa bit 0) wins
    pick = ((~tied) * 10 + torch.arange(8) % 2).argmin(-1)
    want = (grid[pick] * torch.sign(x) * 2.0 ** e).view(48, 256)
    assert torch.equal(deq.double(), want), seed
    assert torch.equal(deq[0, :18], torch.tensor([0, 1, 1, 2, 2, 4, 4, 6, 0, 0, -1, -1, -2, -2, -4, -4, -6, 0]) * 2.0 ** -3)


def test_fp4_refuses_nan_and_other_group_sizes():
    from kconvert.errors import CheckpointError
    from kconvert.quant.fp4_e2m1 import quantize_fp4

    w = torch.zeros(4, 64)
    w[3, 40] = float("nan")
    with pytest.raises(CheckpointError, match="NaN/Inf"):
        quantize_fp4(w, "layers.1.ffn.experts.0.w1.weight")
    assert REGISTRY["fp4"].option_problem(Options(group_size=64))
    assert REGISTRY["fp4"].misfit((8, 48), Options())
