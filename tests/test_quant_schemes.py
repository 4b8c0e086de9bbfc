"""kconvert/quant: every registered scheme stores what its specs say, dequantizes by the formula
(checked against plain arithmetic written here), and shard and export count what they read alike."""

from __future__ import annotations

import os

import pytest
import torch

from kconvert.io.dtypes import DTYPES
from kconvert.quant.registry import REGISTRY, SHARD_SCHEMES
from kconvert.quant.scheme import COMPRESSED_TENSORS, KCONVERT, Options

CASES = [(name, enc) for name in REGISTRY for enc in (KCONVERT, COMPRESSED_TENSORS)]


def _by_hand(name: str, enc: str, stored: list[torch.Tensor], group: int, cols: int) -> torch.Tensor:
    """The stored tensors back to float32, element by element as docs/FORMAT.md and docs/EXPORT.md say."""
    q, s = stored[0], stored[1].float()
    rows = q.shape[0]
    if name == "fp8":
        return q.float() * s[torch.arange(rows)[:, None] // 128, torch.arange(cols)[None, :] // 128]
    if name in ("int8", "fp8_channel"):
        return q.float() * s
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
        assert err <= (ref.abs().max().item() / (7.0 if name == "int4" else 127.0 if name == "int8" else 8.0)), (name, enc, seed)


def test_schemes_listed_once():
    from cli.shard_cmd import shard
    from kconvert.converted.catalog import SCHEMES as catalog_schemes
    from kconvert.convert.quant_policy import SCHEMES as policy_schemes

    assert catalog_schemes == policy_schemes == SHARD_SCHEMES == ("none", "fp8", "int8", "int4")
    quant = next(p for p in shard.params if p.name == "quant")
    assert tuple(quant.type.choices) == SHARD_SCHEMES


def test_shard_and_export_count_an_int4_source_by_its_stored_bytes(checkpoint, tmp_path):
    """Both planners count what they read as the source stores it: packed INT4 is half a byte a value
    (shard once counted a byte, so it reported twice the bytes read and GB/s of an INT4 release)."""
    from kconvert.convert.export import ExportJob, plan_export
    from kconvert.convert.layout import Layout
    from kconvert.convert.quant_policy import QuantPolicy
    from kconvert.convert.shard_plan import plan_items
    from kconvert.source.checkpoint import Checkpoint

    ck = Checkpoint.open(checkpoint("tiny-k3-int4"))
    stored = sum(t.main.nbytes for t in ck.logical.values())
    assert any(t.format == "int4_packed" for t in ck.logical.values())
    for quant in ("none", "int4", "fp8"):
        items = plan_items(ck, Layout.make(1, 1), QuantPolicy(quant), keep_mtp=True)
        assert sum(w.bytes_in for w in items) == stored, quant
    for fmt in ("w4a16", "fp8-block"):
        files = plan_export(ck, ExportJob(str(ck.root), str(tmp_path / fmt), fmt), "fp32")
        assert sum(e.bytes_in for f in files for e in f) == stored, fmt
