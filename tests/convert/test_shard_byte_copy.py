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


@pytest.mark.parametrize("tp", [1, 2])
def test_bytes_equal_the_tensor_path(checkpoint, tmp_path, monkeypatch, tp):
    import kconvert.convert.shard.job as job

    src, as_bytes = checkpoint("tiny-k25-dsv32"), []
    real = job.write_unit_bytes
    monkeypatch.setattr(job, "write_unit_bytes", lambda *a: as_bytes.append(a[1][0].unit) or real(*a))
    assert cli_here("shard", src, tmp_path / "bytes", "--tp", tp).returncode == 0
    assert as_bytes  # (every unit)
    monkeypatch.setattr(job, "plain_copies", lambda ck, items: False)  # the tensor path (unit.write_unit)
    assert cli_here("shard", src, tmp_path / "tensors", "--tp", tp).returncode == 0
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
