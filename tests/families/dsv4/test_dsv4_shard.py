"""`kconvert shard` of DeepSeek-V4 with --quant none at tp 1 and tp 2: every rank holds exactly the slices
serving engines use (wq_b / wo_a / attn_sink by heads and output groups, wo_b by rows' inputs, shared
experts col/row, routed experts whole per rank, everything else replicated), dequantized exactly from
the FP8 + FP4 release storage, F32 and int64 tensors as stored. The expected slices are written here from
the rule table (not from kconvert's layout code). --quant fp4 keeps the FP4 experts' bytes, fp8 re-encodes
them exactly, int8 / int4 quantize the exact dequantization; damaged data is one line, exit 2, no kconvert.json."""

from __future__ import annotations

import re

import pytest
import torch

from helpers import assert_one_line_error, cli_here, read_meta
from kconvert.load.loader import open_converted
from kconvert.source.checkpoint import Checkpoint

# (pattern, dim cut across tp ranks); routed experts are placed whole; anything else is replicated
CUT = ((r"\.attn\.wq_b\.weight$", 0), (r"\.attn\.wo_a\.weight$", 0), (r"\.attn\.attn_sink$", 0),
       (r"\.attn\.wo_b\.weight$", 1), (r"\.shared_experts\.w[13]\.weight$", 0), (r"\.shared_experts\.w2\.weight$", 1),
       (r"^(embed|head)\.weight$", 0))
N_EXPERTS = 8


def expected(ck: Checkpoint, name: str, rank: int, tp: int) -> torch.Tensor | None:
    t = ck.read(name)
    if ck.logical[name].format != "plain":
        t = t.to(torch.bfloat16)  # --quant none: FP8 / FP4 dequantized exactly, stored as bf16
    m = re.search(r"\.experts\.(\d+)\.", name)
    if m:
        return t if int(m[1]) // (N_EXPERTS // tp) == rank else None
    for pattern, dim in CUT:
        if re.search(pattern, name):
            step = t.shape[dim] // tp
            return t.narrow(dim, rank * step, step)
    return t


@pytest.mark.parametrize("preset,tp", [("tiny-dsv4-flash", 1), ("tiny-dsv4-flash", 2), ("tiny-dsv4", 2)])
def test_every_rank_holds_its_slices(checkpoint, tmp_path, preset, tp):
    src = checkpoint(preset)
    out = tmp_path / "out"
    proc = cli_here("shard", src, out, "--tp", tp)
    assert proc.returncode == 0, proc.stderr
    ck = Checkpoint.open(src)
    want_names = set(ck.logical)  # the MTP block too: draft heads are converted by default
    for rank in range(tp):
        conv = open_converted(out, rank)
        got: dict[str, torch.Tensor] = {}
        for unit in conv.catalog.units:
            got.update(conv.load_unit(unit, verify=True))
        mine = {n for n in want_names if expected(ck, n, rank, tp) is not None}
        assert set(got) == mine, (sorted(set(got) ^ mine)[:5])
        for name in mine:
            e = expected(ck, name, rank, tp)
            assert got[name].dtype == e.dtype and torch.equal(got[name], e), (rank, name)
    # the groups of wo_a stay whole: rank r holds output groups r * (o_groups / tp) ...
    if tp == 2:
        assert got["layers.0.attn.wo_a.weight"].shape[0] == 64  # 1 of 2 groups of o_lora_rank 64


def test_the_mtp_block_is_a_unit_of_its_own(checkpoint, tmp_path):
    out = tmp_path / "out"
    assert cli_here("shard", checkpoint("tiny-dsv4-flash"), out, "--tp", 1).returncode == 0
    conv = open_converted(out, 0)
    assert "layer-0004" in conv.catalog.units
    mtp = conv.load_unit("layer-0004")
    assert "mtp.0.e_proj.weight" in mtp and "mtp.0.ffn.experts.7.w2.weight" in mtp


def test_fp8_reencodes_fp4_experts_exactly(checkpoint, tmp_path):
    """--quant fp8 (GPUs without FP4): each FP4 expert becomes e4m3 + a power-of-two 128x128 scale holding
    the very same values; FP8 dense linears are copied with their e8m0 scales as float32 powers of two."""
    src = checkpoint("tiny-dsv4-flash")
    out = tmp_path / "out"
    proc = cli_here("shard", src, out, "--tp", 1, "--quant", "fp8")
    assert proc.returncode == 0, proc.stderr
    ck = Checkpoint.open(src)
    conv = open_converted(out, 0)
    got = {}
    for unit in conv.catalog.units:
        got.update(conv.load_unit(unit, verify=True))
    transforms = {t["name"]: t["transform"] for t in read_meta(out)["tensors"]}
    checked = 0
    for name, t in ck.logical.items():
        if t.format == "plain" or name.startswith("mtp."):
            continue
        assert transforms[name] == ("fp4_to_fp8" if ".experts." in name else "fp8_copy"), name
        q, s = got[name], got[name + "_scale_inv"]
        assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
        assert torch.equal(torch.log2(s), torch.log2(s).round()), name  # powers of two
        per = s.repeat_interleave(128, 0)[: q.shape[0]].repeat_interleave(128, 1)[:, : q.shape[1]]
        assert torch.equal(q.to(torch.float32) * per, ck.read(name).to(torch.float32)), name
        checked += 1
    assert checked == 130  # 4 layers x 8 experts x 3 linears in FP4, 34 dense linears in FP8


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_int_schemes_quantize_the_dequantized_release(checkpoint, tmp_path, quant):
    """--quant int8 / int4 from the release: the exact dequantization, quantized by the scheme (its own
    tests and verify's faithfulness check judge the rounding); int4 takes the routed experts only."""
    out = tmp_path / "out"
    proc = cli_here("shard", checkpoint("tiny-dsv4-flash"), out, "--tp", 2, "--quant", quant)
    assert proc.returncode == 0, proc.stderr
    meta = read_meta(out)
    by = {}
    for t in meta["tensors"]:
        by.setdefault(t["transform"], set()).add(t["name"])
    assert meta["quantization"]["scheme"] == quant
    assert all(".experts." in n for n in by[quant]) == (quant == "int4") and len(by[quant]) > 0


@pytest.mark.parametrize("tp", [1, 2])
def test_fp4_keeps_the_release_experts_bit_for_bit(checkpoint, tmp_path, tp):
    """--quant fp4: routed experts are the release's FP4 bytes (int8 pairs as U8, the same e8m0 scales),
    copied, never re-rounded; everything else as with --quant none."""
    from safetensors.torch import load_file

    src = checkpoint("tiny-dsv4-flash")
    out = tmp_path / "out"
    proc = cli_here("shard", src, out, "--tp", tp, "--quant", "fp4")
    assert proc.returncode == 0, proc.stderr
    raw = {}
    for f in src.glob("model-*.safetensors"):
        raw.update(load_file(f))
    ck = Checkpoint.open(src)
    experts = 0
    for rank in range(tp):
        conv = open_converted(out, rank)
        got = {}
        for unit in conv.catalog.units:
            got.update(conv.load_unit(unit, verify=True))
        for name in ck.logical:
            if name.startswith("mtp."):
                continue
            e = expected(ck, name, rank, tp)
            if e is None:
                continue
            if ".experts." in name:
                stem = name[: -len(".weight")]
                assert got[name + "_packed"].dtype == torch.uint8 and got[name + "_scale"].dtype == torch.float8_e8m0fnu
                assert torch.equal(got[name + "_packed"], raw[name].view(torch.uint8)), name
                assert torch.equal(got[name + "_scale"].view(torch.uint8), raw[stem + ".scale"].view(torch.uint8)), name
                experts += 1
            else:
                assert torch.equal(got[name], e), name
    assert experts == 4 * 8 * 3
    transforms = {t["transform"] for t in open_converted(out, 0).catalog.tensors}
    assert "fp4_copy" in transforms and "fp4" not in transforms


def test_fp4_refuses_to_cut_packed_experts(checkpoint, tmp_path):
    out = tmp_path / "out"
    assert_one_line_error(cli_here("shard", checkpoint("tiny-dsv4-flash"), out, "--tp", 2, "--ep", 1, "--quant", "fp4"),
                          "inside a packed FP4 tensor (copied whole only)", "--requantize")
    assert not (out / "kconvert.json").exists()


def test_tp_that_cuts_output_groups_is_refused(checkpoint, tmp_path):
    out = tmp_path / "out"
    assert_one_line_error(cli_here("shard", checkpoint("tiny-dsv4"), out, "--tp", 4), "does not fit this model",
                          "wo_a.weight", "64-wide groups over 4 ranks", "tp degrees that work: 1, 2")
    assert not (out / "kconvert.json").exists()


def _poke(entry, offset: int, data: bytes) -> None:
    with open(entry.file, "r+b") as f:
        f.seek(entry.begin + offset)
        f.write(data)


def test_nan_e8m0_scale_fails_the_shard(checkpoint, copy_checkpoint, tmp_path):
    src = copy_checkpoint(checkpoint("tiny-dsv4-flash"))
    _poke(Checkpoint.open(src).stored["layers.3.ffn.experts.2.w2.scale"], 5, b"\xff")
    out = tmp_path / "out"
    assert_one_line_error(cli_here("shard", src, out, "--tp", 1), "tensor layers.3.ffn.experts.2.w2.scale", "NaN")
    assert not (out / "kconvert.json").exists()


def test_tid2eid_out_of_range_fails_the_shard(checkpoint, copy_checkpoint, tmp_path):
    src = copy_checkpoint(checkpoint("tiny-dsv4"))
    _poke(Checkpoint.open(src).stored["layers.0.ffn.gate.tid2eid"], 8 * 11, (-1).to_bytes(8, "little", signed=True))
    out = tmp_path / "out"
    assert_one_line_error(cli_here("shard", src, out, "--tp", 2), "tensor layers.0.ffn.gate.tid2eid",
                          "entry -1 at [5, 1] is outside [0, 8)")
    assert not (out / "kconvert.json").exists()


def test_tp2_pp2_stages_hold_the_same_slices(checkpoint, tmp_path):
    """tp 2 x pp 2: each stage's ranks hold exactly their tp rank's slices of their own layers; together
    the stages hold every tensor once per tp rank (MTP kept on the last stage)."""
    src = checkpoint("tiny-dsv4-flash")
    out = tmp_path / "out"
    assert cli_here("shard", src, out, "--tp", 2, "--pp", 2, "--keep-mtp").returncode == 0
    ck = Checkpoint.open(src)
    for tp_rank in range(2):
        seen: set[str] = set()
        for stage in range(2):
            conv = open_converted(out, stage * 2 + tp_rank)
            for unit in conv.catalog.stage_units(stage):
                for name, t in conv.load_unit(unit).items():
                    e = expected(ck, name, tp_rank, 2)
                    assert e is not None and torch.equal(t, e), (stage, tp_rank, name)
                    if name in seen:
                        assert name in ("embed.weight", "head.weight", "norm.weight") or name.startswith("hc_head"), name
                    seen.add(name)
        assert seen == {n for n in ck.logical if expected(ck, n, tp_rank, 2) is not None}
        assert any(n.startswith("mtp.0.") for n in seen)


# V4-Pro's expert width (moe_intermediate_size 3072), 16 heads, 16 output groups, 16 experts: every head and
# group slice at tp 16 is 128 wide, so only the shared experts' 3072 / 16 = 192-wide slices cut a 128x128 FP8
# block, as in the release
PRO_SHARED = {"hidden_size": 128, "num_hidden_layers": 1, "num_attention_heads": 16, "head_dim": 128, "o_groups": 16,
              "o_lora_rank": 128,
              "q_lora_rank": 64, "moe_intermediate_size": 3072, "n_routed_experts": 16, "num_experts_per_tok": 2,
              "layer_types": ["sliding_attention"], "mlp_layer_types": ["moe"], "index_n_heads": 2, "index_head_dim": 32,
              "hc_mult": 2, "num_nextn_predict_layers": 0}


def test_v4_pro_shared_experts_at_tp16(tmp_path):
    """V4-Pro at tp 16 (FACTS.md: 'impossible' elsewhere): the FP8 copy is refused in one line naming the
    degrees that keep blocks whole; --requantize re-quantizes exactly those slices (each rank's own 128x128
    grid), and --quant none slices the exact dequantization."""
    from kconvert.fixtures.models.dsv4 import build_v4_model, write_v4_model
    from kconvert.quant.fp8_block import dequantize_fp8_block

    src = tmp_path / "pro"
    src.mkdir()
    write_v4_model(build_v4_model(3, PRO_SHARED), src, 3, "flash")
    name = "layers.0.ffn.shared_experts.w1.weight"
    out = tmp_path / "fp8"
    assert_one_line_error(cli_here("shard", src, out, "--tp", 16, "--quant", "fp8"),
                          f"--tp 16 cuts {name}", "tp degrees that keep blocks whole: 1, 2, 4, 8", "--requantize")
    assert not out.exists()
    proc = cli_here("shard", src, out, "--tp", 16, "--quant", "fp8", "--requantize")
    assert proc.returncode == 0, proc.stderr
    want = Checkpoint.open(src).read(name).to(torch.float32)
    for rank in (0, 1, 15):
        conv = open_converted(out, rank)
        got = conv.load_unit("layer-0000", verify=True)
        w = dequantize_fp8_block(got[name], got[name + "_scale_inv"])
        ref = want[rank * 192:(rank + 1) * 192]
        assert w.shape == (192, 128) and got[name + "_scale_inv"].shape == (2, 1)
        assert (w - ref).abs().max() <= ref.abs().amax() / 16, rank  # e4m3 rounding of the source values
        e = {t["name"]: t["transform"] for t in read_meta(out)["tensors"]}
        assert e[name] == "fp8" and e["layers.0.attn.wq_a.weight"] == "fp8_copy"
