"""A job of plain copies (`shard --quant none` of a BF16 source) is written as bytes without torch
(convert/shard/byte_copy.py): the same files as the tensor path, byte for byte; torch never imported; a NaN / Inf
in the source refused with the tensor path's one line, nothing half-written; the NaN/Inf test agrees with torch's on
every float dtype, at every sign and position."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from helpers import ROOT, assert_one_line_error, cli_here, header_offsets, run_cli
from kconvert.convert.shard import byte_copy


def _tree(out) -> dict:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*.safetensors"))}


@pytest.mark.parametrize("preset,quant", [("tiny-k25-dsv32", "none"), ("tiny-k25-dsv32-fp8", "fp8"),
                                          ("tiny-kimi-k3", "fp4")])
@pytest.mark.parametrize("tp", [1, 2])
def test_bytes_equal_the_tensor_path(checkpoint, tmp_path, monkeypatch, tp, preset, quant):
    """`--quant none` of BF16, `--quant fp8` of block FP8 (its blocks and scales resharded, its BF16 tensors kept) and
    `--quant fp4` of Kimi K3 as released (its MXFP4 experts' U8 bytes kept, the scales tagged e8m0; the rest BF16) are
    byte copies: the same files as the tensor path writes."""
    import kconvert.convert.shard.job as job

    src, as_bytes = checkpoint(preset), []
    real = job.write_unit_bytes
    monkeypatch.setattr(job, "write_unit_bytes", lambda *a: as_bytes.append(a[1][0].unit) or real(*a))
    assert cli_here("shard", src, tmp_path / "bytes", "--tp", tp, "--quant", quant).returncode == 0
    assert as_bytes  # (every unit)
    monkeypatch.setattr(job, "plain_copies", lambda ck, items: False)  # the tensor path (unit.write_unit)
    assert cli_here("shard", src, tmp_path / "tensors", "--tp", tp, "--quant", quant).returncode == 0
    a, b = _tree(tmp_path / "bytes"), _tree(tmp_path / "tensors")
    assert list(a) == list(b) and a == b
    ja, jb = (json.loads((tmp_path / d / "kconvert.json").read_text()) for d in ("bytes", "tensors"))
    assert ja["files"] == jb["files"]  # every file's size and CRC-32


def test_a_plain_reshard_never_imports_torch(checkpoint, tmp_path):
    code = ("import sys; from cli.main import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "print('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code, "shard", str(checkpoint("tiny-dsv32")), str(tmp_path / "o"),
                        "--tp", "2"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "False"
    assert (tmp_path / "o" / "kconvert.json").exists()


@pytest.mark.parametrize("raw", [b"\xc0\x7f", b"\x80\xff", b"\x80\x7f"])  # bf16 NaN, -Inf, +Inf
def test_nan_or_inf_refused_naming_file_and_tensor(checkpoint, copy_checkpoint, tmp_path, raw):
    src = copy_checkpoint(checkpoint("tiny-k25-dsv32"))
    index = json.loads((src / "model.safetensors.index.json").read_text())
    name = "language_model.model.layers.1.self_attn.o_proj.weight"  # cut along dim 1 at tp 2
    path = src / index["weight_map"][name]
    start, header = header_offsets(path)
    lo, hi = header[name]["data_offsets"]
    data = bytearray(path.read_bytes())
    at = start + lo + ((hi - lo) // 2 & ~1)
    data[at:at + 2] = raw
    path.write_bytes(bytes(data))
    r = run_cli("shard", src, tmp_path / "o", "--tp", 2)
    assert_one_line_error(r, name, path.name, "1 NaN/Inf")
    assert not (tmp_path / "o" / "kconvert.json").exists()
    assert not [p for p in (tmp_path / "o").rglob("*") if ".tmp-" in p.name]  # the unit's temporaries removed


@pytest.mark.parametrize("tag,dtype", [("BF16", torch.bfloat16), ("F16", torch.float16), ("F32", torch.float32),
                                       ("F64", torch.float64), ("F8_E4M3", torch.float8_e4m3fn),
                                       ("F8_E5M2", torch.float8_e5m2)])
def test_the_nonfinite_test_agrees_with_torch(tag, dtype):
    from kconvert.source.formats import _count_nonfinite, all_finite

    class Entry:
        file, name = "f.safetensors", "t"

    Entry.dtype = tag
    gen = torch.Generator().manual_seed(0)
    for trial in range(40):
        x = (torch.randn(257, generator=gen) * 10 ** (trial % 4)).to(dtype)
        if trial % 5:  # most trials: one to three NaN / +-Inf / largest-finite values dropped in anywhere
            for _ in range(1 + trial % 3):
                i = int(torch.randint(0, x.numel(), (1,), generator=gen))
                x[i] = [float("nan"), float("inf"), float("-inf"), torch.finfo(dtype).max, -torch.finfo(dtype).max][
                    int(torch.randint(0, 5, (1,), generator=gen))]
        data = np.frombuffer(x.view(torch.uint8).numpy().tobytes(), np.uint8)
        if all_finite(x):
            byte_copy.require_finite_bytes(data, Entry)
        else:
            with pytest.raises(Exception, match=f"^{_count_nonfinite(x)} NaN/Inf"):
                byte_copy.require_finite_bytes(data, Entry)


FP8_L1 = "language_model.model.layers.1.self_attn.kv_b_proj"


@pytest.mark.parametrize("part,raw", [(".weight", b"\x7f"), (".weight_scale_inv", b"\x00\x00\xc0\x7f"),
                                      (".weight_scale_inv", b"\x99\x76\x96\x7b")])  # FP8 NaN, scale NaN, 1.56e36
def test_a_damaged_fp8_copy_is_refused_as_the_tensor_path_refuses_it(checkpoint, copy_checkpoint, tmp_path,
                                                                     monkeypatch, part, raw):
    """A NaN in an FP8 weight or its scales, or a scale that decodes past float32: the byte copy's one line is the
    tensor path's, word for word, and neither leaves a converted directory."""
    src = copy_checkpoint(checkpoint("tiny-k25-dsv32-fp8"))
    _both_paths_refuse(src, FP8_L1 + part, raw, "fp8", tmp_path, monkeypatch, "damaged")


K3_EXPERT = "language_model.model.layers.1.block_sparse_moe.experts.3.w1"


@pytest.mark.parametrize("raw", [b"\xff", b"\xfe"])  # e8m0 NaN; 2^127 * 6 past float32
def test_a_damaged_mxfp4_copy_is_refused_as_the_tensor_path_refuses_it(checkpoint, copy_checkpoint, tmp_path,
                                                                      monkeypatch, raw):
    """Kimi K3's `--quant fp4` as bytes: an e8m0 scale that is NaN, or one whose largest value passes float32, is
    refused in the tensor path's words, and neither path leaves a converted directory."""
    src = copy_checkpoint(checkpoint("tiny-kimi-k3"))
    _both_paths_refuse(src, K3_EXPERT + ".weight_scale", raw, "fp4", tmp_path, monkeypatch)


def _both_paths_refuse(src, name: str, raw: bytes, quant: str, tmp_path, monkeypatch, *words: str) -> None:
    """`raw` written over the second element of stored tensor `name`; shard --tp 2 as bytes and through the tensor path:
    the same one line naming it, and no converted directory from either."""
    import kconvert.convert.shard.job as job

    path = src / json.loads((src / "model.safetensors.index.json").read_text())["weight_map"][name]
    start, header = header_offsets(path)
    lo, _ = header[name]["data_offsets"]
    data = bytearray(path.read_bytes())
    data[start + lo + len(raw):start + lo + 2 * len(raw)] = raw
    path.write_bytes(bytes(data))
    lines = []
    for as_bytes in (True, False):
        if not as_bytes:
            monkeypatch.setattr(job, "plain_copies", lambda ck, items: False)
        r = cli_here("shard", src, tmp_path / f"o{as_bytes}", "--tp", 2, "--quant", quant)
        assert_one_line_error(r, name, *words)
        assert not (tmp_path / f"o{as_bytes}" / "kconvert.json").exists()
        lines.append(r.stderr.replace(str(tmp_path / f"o{as_bytes}"), "OUT"))
    assert lines[0] == lines[1]


def test_an_interrupted_byte_copy_resumes_to_the_same_files(checkpoint, tmp_path, monkeypatch):
    """The byte path journals each unit after its files are durable, as the tensor path does: a run stopped after two
    units leaves them journalled and no kconvert.json; the same command resumes after them and ends with the files
    of an uninterrupted run."""
    import kconvert.convert.shard.job as job

    src = checkpoint("tiny-k25-dsv32")
    assert cli_here("shard", src, tmp_path / "ref", "--tp", 2).returncode == 0
    real, done = job.write_unit_bytes, []

    def stop_at_the_third(*a):
        if len(done) == 2:
            raise KeyboardInterrupt
        done.append(1)
        return real(*a)

    monkeypatch.setattr(job, "write_unit_bytes", stop_at_the_third)
    stopped = cli_here("shard", src, tmp_path / "out", "--tp", 2, "--workers", 1)  # (one worker: units in order)
    assert stopped.returncode != 0 and not (tmp_path / "out" / "kconvert.json").exists()
    monkeypatch.setattr(job, "write_unit_bytes", real)
    r = cli_here("shard", src, tmp_path / "out", "--tp", 2, "--workers", 1, "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["files_resumed"] >= 2
    assert _tree(tmp_path / "out") == _tree(tmp_path / "ref")
