"""DeepSeek-V4 storage read exactly: FP8 e4m3 with a `.scale` sidecar (e8m0 powers of two or float32) per
128x128 block, FP4 e2m1 experts packed two per byte as int8 with an e8m0 scale per 32 inputs, int64
tid2eid tables and float32 tensors as stored. Every check is against an independent formula written
here on fresh random bytes; damaged scales (0xFF = NaN) and tables are one error naming file and tensor."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kconvert.errors import CheckpointError, NonFiniteError
from kconvert.fixtures.storage.shards import write_tensors
from kconvert.io.safetensors_read import read_header
from kconvert.source.checkpoint import Checkpoint
from kconvert.source.formats import read_logical
from kconvert.source.logical import fold

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def e4m3_value(byte: int) -> float:
    """float8_e4m3fn from its bits: 1 sign, 4 exponent (bias 7), 3 mantissa; subnormals at exponent 0."""
    sign = -1.0 if byte & 0x80 else 1.0
    exp, man = (byte >> 3) & 0xF, byte & 0x7
    return sign * (man / 8 * 2.0 ** -6 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7))


def fp4_value(code: int) -> float:
    return (-1.0 if code & 8 else 1.0) * E2M1[code & 7]


def stored(tmp_path, tensors: dict[str, torch.Tensor]):
    write_tensors(tmp_path, tensors, sorted(tensors), 1)
    header = read_header(next(tmp_path.glob("model-*.safetensors")))
    return fold(dict(header.tensors))


def random_e4m3(gen, rows, cols) -> torch.Tensor:
    b = torch.randint(0, 256, (rows, cols), generator=gen, dtype=torch.uint8)
    b[(b & 0x7F) == 0x7F] = 0x11  # the NaN patterns: not weights
    return b.view(torch.float8_e4m3fn)


def test_fp8_with_e8m0_scale_is_weight_times_power_of_two(tmp_path):
    gen = torch.Generator().manual_seed(1)
    w = random_e4m3(gen, 200, 300)  # partial edge blocks both ways
    e = torch.randint(100, 150, (2, 3), generator=gen, dtype=torch.uint8)
    t = stored(tmp_path, {"layers.0.attn.wq_b.weight": w, "layers.0.attn.wq_b.scale": e.view(torch.float8_e8m0fnu)})
    logical = t["layers.0.attn.wq_b.weight"]
    assert logical.format == "block_fp8" and logical.shape == (200, 300)
    wb, eb = w.view(torch.uint8).numpy(), e.numpy()
    expect = np.array([[e4m3_value(int(wb[i, j])) * 2.0 ** (int(eb[i // 128, j // 128]) - 127) for j in range(300)]
                       for i in range(200)], dtype=np.float64)
    got = read_logical(logical).double().numpy()
    assert np.array_equal(got, expect)
    rows = read_logical(logical, rows=(130, 170)).double().numpy()  # a row range starting mid-block
    assert np.array_equal(rows, expect[130:170])


def test_fp8_with_float32_scale(tmp_path):
    gen = torch.Generator().manual_seed(2)
    w = random_e4m3(gen, 128, 256)
    s = torch.rand(1, 2, generator=gen) * 0.01
    t = stored(tmp_path, {"mtp.0.e_proj.weight": w, "mtp.0.e_proj.scale": s})
    got = read_logical(t["mtp.0.e_proj.weight"])
    wb = w.view(torch.uint8).numpy()
    expect = np.array([[np.float32(e4m3_value(int(wb[i, j]))) * s[0, j // 128].item() for j in range(256)]
                       for i in range(128)], dtype=np.float32)
    assert np.array_equal(got.numpy(), expect)


def test_fp4_experts_decode_low_nibble_first(tmp_path):
    gen = torch.Generator().manual_seed(3)
    packed = torch.randint(-128, 128, (6, 48), generator=gen, dtype=torch.int8)  # 96 inputs: 3 groups of 32
    e = torch.randint(110, 140, (6, 3), generator=gen, dtype=torch.uint8)
    name = "layers.2.ffn.experts.5.w1.weight"
    t = stored(tmp_path, {name: packed, "layers.2.ffn.experts.5.w1.scale": e.view(torch.float8_e8m0fnu)})
    assert t[name].format == "fp4_packed" and t[name].shape == (6, 96)
    pb, eb = packed.view(torch.uint8).numpy(), e.numpy()
    expect = np.zeros((6, 96))
    for i in range(6):
        for j in range(96):
            byte = int(pb[i, j // 2])
            code = byte & 0xF if j % 2 == 0 else byte >> 4
            expect[i, j] = fp4_value(code) * 2.0 ** (int(eb[i, j // 32]) - 127)
    assert np.array_equal(read_logical(t[name]).double().numpy(), expect)
    assert np.array_equal(read_logical(t[name], rows=(2, 5)).double().numpy(), expect[2:5])


@pytest.mark.parametrize("kind", ["fp8", "fp4"])
def test_e8m0_nan_scale_is_refused_naming_file_and_tensor(tmp_path, kind):
    if kind == "fp8":
        w, scale = random_e4m3(torch.Generator().manual_seed(4), 128, 128), torch.full((1, 1), 127, dtype=torch.uint8)
    else:
        w, scale = torch.zeros(4, 16, dtype=torch.int8), torch.full((4, 1), 127, dtype=torch.uint8)
    scale[-1, -1] = 0xFF
    t = stored(tmp_path, {"x.weight": w, "x.scale": scale.view(torch.float8_e8m0fnu)})
    with pytest.raises(NonFiniteError) as e:
        read_logical(t["x.weight"])
    line = e.value.one_line()
    assert "model-00001-of-00001.safetensors" in line and "tensor x.scale" in line and "NaN" in line


@pytest.mark.parametrize("tensors,needle", [
    ({"x.scale": torch.ones(1, 1)}, "quantization scale without its weight"),
    ({"x.weight": torch.zeros(4, 16, dtype=torch.int8), "x.scale": torch.ones(4, 1)}, "needs an F8_E8M0 scale [4, 1]"),
    ({"x.weight": torch.zeros(4, 16, dtype=torch.int8),
      "x.scale": torch.full((4, 2), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)}, "needs an F8_E8M0 scale [4, 1]"),
    ({"x.weight": torch.zeros(4, 16), "x.scale": torch.ones(1, 1)}, "belongs to an F8_E4M3 or packed-FP4"),
])
def test_malformed_sidecars_are_refused(tmp_path, tensors, needle):
    with pytest.raises(CheckpointError) as e:
        stored(tmp_path, tensors)
    assert needle in e.value.one_line() and "tensor x." in e.value.one_line()


def test_fixture_float32_and_int64_tensors_read_exactly(checkpoint):
    from safetensors.torch import load_file

    src = checkpoint("tiny-dsv4-flash")
    ck = Checkpoint.open(src)
    ck.validate()
    raw = {}
    for f in src.glob("model-*.safetensors"):
        raw.update(load_file(f))
    for name in ("layers.0.ffn.gate.tid2eid", "layers.1.hc_attn_fn", "layers.1.attn.compressor.ape",
                 "layers.3.ffn.gate.bias", "layers.0.attn.attn_sink", "hc_head_scale"):
        got = ck.read(name)
        assert got.dtype == raw[name].dtype and torch.equal(got, raw[name]), name
    assert raw["layers.0.ffn.gate.tid2eid"].dtype == torch.int64
    assert ck.logical["layers.2.ffn.experts.0.w2.weight"].format == "fp4_packed"
    assert ck.logical["layers.2.attn.wo_a.weight"].format == "block_fp8"
    assert ck.logical["layers.2.attn.compressor.wkv.weight"].format == "plain"  # bf16 in the release


def test_tid2eid_out_of_range_is_refused(checkpoint, copy_checkpoint):
    src = copy_checkpoint(checkpoint("tiny-dsv4"))
    ck = Checkpoint.open(src)
    entry = ck.stored["layers.1.ffn.gate.tid2eid"]
    with open(entry.file, "r+b") as f:  # row 3, column 1 := 8 (experts are 0..7)
        f.seek(entry.begin + (3 * 2 + 1) * 8)
        f.write((8).to_bytes(8, "little", signed=True))
    with pytest.raises(CheckpointError) as e:
        Checkpoint.open(src).read("layers.1.ffn.gate.tid2eid")
    line = e.value.one_line()
    assert entry.file.name in line and "tensor layers.1.ffn.gate.tid2eid" in line
    assert "entry 8 at [3, 1] is outside [0, 8)" in line
    Checkpoint.open(src).read("layers.0.ffn.gate.tid2eid")  # the other table is intact


def test_tid2eid_stored_as_float_is_refused(tmp_path, checkpoint, copy_checkpoint):
    src = copy_checkpoint(checkpoint("tiny-dsv4"))
    index = json.loads((src / "model.safetensors.index.json").read_text())
    f = src / index["weight_map"]["layers.0.ffn.gate.tid2eid"]
    header_len = int.from_bytes(f.read_bytes()[:8], "little")
    header = json.loads(f.read_bytes()[8:8 + header_len])
    header["layers.0.ffn.gate.tid2eid"]["dtype"] = "F64"  # same size: only the header lies
    text = json.dumps(header, separators=(",", ":")).encode().ljust(header_len)
    assert len(text) == header_len
    data = f.read_bytes()
    f.write_bytes(data[:8] + text + data[8 + header_len:])
    with pytest.raises(Exception) as e:
        Checkpoint.open(src).validate()
    assert "an index table must be I64 or I32" in str(e.value)
