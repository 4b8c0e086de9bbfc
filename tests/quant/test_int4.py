"""`--quant int4`: the quantizer against compressed-tensors' fake quantization, the packed format as
docs/FORMAT.md writes it (read back here independently), what `shard` writes and `plan` counts, and
that the engine runs it faithfully."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from helpers import assert_one_line_error, read_meta, run_cli
from kconvert.quant.int4_group import quantize_int4_group
from kconvert.quant.packing import unpack_nibble_pairs
from kconvert.verify.fake_quant import qdq


def _random(seed: int, rows=64, cols=256) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.02
    w[3, 40:72] = 0.0  # an all-zero group
    w[5, 7] = 0.5  # an outlier: clipping pays off around it
    return w


def _dequant_by_the_doc(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """docs/FORMAT.md: q[i, 2k] = (byte & 0xF) - 8, q[i, 2k+1] = (byte >> 4) - 8, w = q * scale[i, j // G]."""
    lo = (packed.to(torch.int16) & 0xF) - 8
    hi = (packed.to(torch.int16) >> 4) - 8
    q = torch.empty(packed.shape[0], packed.shape[1] * 2, dtype=torch.float32)
    q[:, 0::2], q[:, 1::2] = lo.float(), hi.float()
    G = q.shape[1] // scale.shape[1]
    return q * scale.repeat_interleave(G, dim=1)


@pytest.mark.parametrize("search", ["mse", "amax"])
@pytest.mark.parametrize("group", [32, 64])
def test_int4_matches_compressed_tensors_fake_quantize(search, group):
    seed = int.from_bytes(os.urandom(4), "little")
    w = _random(seed)
    packed, scale = quantize_int4_group(w, group, search)
    assert packed.dtype == torch.uint8 and packed.shape == (64, 128) and scale.shape == (64, 256 // group)
    ours = _dequant_by_the_doc(packed, scale)
    assert torch.equal(ours, qdq(w, "int4", group_size=group, int4_scales=search)), seed
    assert torch.equal(unpack_nibble_pairs(packed).float() * scale.repeat_interleave(group, 1), ours)
    assert torch.equal(ours[3, 40:72], torch.zeros(32))


def test_clipping_search_never_loses_to_amax():
    w = _random(1)
    err = {s: (_dequant_by_the_doc(*quantize_int4_group(w, 32, s)) - w).pow(2).view(64, 8, 32).sum(-1)
           for s in ("mse", "amax")}
    assert bool((err["mse"] <= err["amax"]).all()) and float(err["mse"].sum()) < 0.97 * float(err["amax"].sum())


@pytest.fixture(scope="module")
def int4_tp2(checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("int4") / "tp2"
    run_cli("shard", checkpoint("tiny-k25-dsv32"), out, "--tp", 2, "--quant", "int4", check=True)
    return out


def test_shard_int4_stores_routed_experts_packed(int4_tp2, checkpoint):
    meta = read_meta(int4_tp2)
    assert meta["quantization"]["scheme"] == "int4" and meta["quantization"]["group_size"] == 32
    by_name = {t["name"]: t for t in meta["tensors"]}
    e = "language_model.model.layers.2.mlp.experts.3.up_proj.weight"
    assert by_name[e + "_packed"]["dtype"] == "U8" and by_name[e + "_packed"]["shape"] == [256, 128]
    assert by_name[e + "_scale"]["shape"] == [256, 8] and e not in by_name
    shared = "language_model.model.layers.2.mlp.shared_experts.up_proj.weight"
    assert by_name[shared]["dtype"] == "BF16"  # only routed experts by default
    tensors = load_file(int4_tp2 / by_name[e + "_packed"]["file"])
    src = _source_tensor(checkpoint("tiny-k25-dsv32"), e)
    assert torch.equal(_dequant_by_the_doc(tensors[e + "_packed"], tensors[e + "_scale"]), qdq(src, "int4"))


def _source_tensor(root, name):
    from helpers import load_source

    return load_source(root)[name].float()


def test_plan_counts_int4_bytes(checkpoint):
    src = checkpoint("tiny-k25-dsv32")
    got = {}
    for q in ("none", "int4"):
        r = run_cli("plan", src, "--tp", 2, "--quant", q, "--json", check=True)
        got[q] = json.loads(r.stdout)
    # only the routed experts change: 2 bytes (bf16) -> half a byte + a float32 scale per 32 weights
    n_expert = 2 * 8 * 3 * 256 * 256  # per rank: 2 MoE layers x 8 experts x 3 projections of 256 x 256
    assert got["none"]["rank"]["total"] - got["int4"]["rank"]["total"] == 2 * n_expert - (n_expert // 2 + n_expert // 8)


def test_bad_group_size(checkpoint, tmp_path):
    proc = run_cli("shard", checkpoint("tiny-k25-dsv32"), tmp_path / "o", "--tp", 2, "--quant", "int4", "--group-size", 96)
    assert_one_line_error(proc, "groups of 96")
    assert not (tmp_path / "o" / "kconvert.json").exists()
