"""Issue 42, class 2: inputs that used to give a result silently wrong, now refused in one line. An FP4 expert's
e8m0 scale byte 0xFE (2^127: its codes decode past float32) passed `shard --quant fp4` (the bytes copied), `--quant
fp8` (re-encoded) and `export --format fp8-block` while `--quant none` refused it; one check of stored scales now
serves every path. `--calibrate ''` calibrated on the current directory. `sliding_window: null` in a DeepSeek-V4
config. (A trusted calibration resume state: tests/convert/test_calibrate_resume.py.)"""

from __future__ import annotations

import json

import pytest

from helpers import assert_one_line_error, cli_here
from kconvert.source.checkpoint import Checkpoint

EXPERT_SCALE = "layers.3.ffn.experts.2.w1.scale"
DENSE_SCALE = "layers.0.attn.wq_b.scale"


def _poke_byte(src, tensor: str, index: int, value: int) -> None:
    e = Checkpoint.open(src).stored[tensor]
    data = bytearray(e.file.read_bytes())
    data[e.begin + index] = value
    e.file.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def top_scale(checkpoint, tmp_path_factory):
    """tiny-dsv4-flash with one FP4 expert's e8m0 scale byte set to 0xFE (every code of a group times 2^127)."""
    import shutil

    src = tmp_path_factory.mktemp("fe") / "src"
    shutil.copytree(checkpoint("tiny-dsv4-flash"), src)
    _poke_byte(src, EXPERT_SCALE, 3, 0xFE)
    return src


@pytest.mark.parametrize("args", [("shard", "--tp", "1", "--quant", "fp4"), ("shard", "--tp", "1", "--quant", "fp8"),
                                  ("shard", "--tp", "1", "--quant", "none"), ("export", "--format", "fp8-block")],
                         ids=lambda a: " ".join(a[1:]))
def test_fp4_scale_past_float32_is_refused_by_every_path(top_scale, tmp_path, args):
    out = tmp_path / "out"
    p = cli_here(args[0], top_scale, out, *args[1:])
    assert_one_line_error(p, f"tensor {EXPERT_SCALE}", "past float32")
    assert not (out / "kconvert.json").exists() and not (out / "model.safetensors.index.json").exists()


def test_fp8_copy_with_a_scale_past_float32_is_refused(checkpoint, copy_checkpoint, tmp_path):
    """The same check on a block-FP8 weight's e8m0 scale (copied as it is by --quant fp8)."""
    src = copy_checkpoint(checkpoint("tiny-dsv4-flash"))
    _poke_byte(src, DENSE_SCALE, 1, 0xFE)
    assert_one_line_error(cli_here("shard", src, tmp_path / "out", "--tp", "1", "--quant", "fp8"),
                          f"tensor {DENSE_SCALE}", "past float32")


def test_largest_sane_scale_still_converts(checkpoint, copy_checkpoint, tmp_path):
    """2^125 (byte 0xFC) keeps FP4's top code finite: no false refusal at the edge."""
    src = copy_checkpoint(checkpoint("tiny-dsv4-flash"))
    _poke_byte(src, EXPERT_SCALE, 3, 0xFC)
    assert cli_here("shard", src, tmp_path / "out", "--tp", "1", "--quant", "fp4").returncode == 0


def test_empty_calibrate_is_refused(checkpoint, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # what '' used to mean: this directory, recursively
    (tmp_path / "notes.txt").write_text("some text " * 500)
    p = cli_here("shard", checkpoint("tiny-k25-dsv32"), tmp_path / "out", "--tp", "1", "--quant", "int4", "--calibrate", "")
    assert_one_line_error(p, "--calibrate")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("preset", ["tiny-dsv4", "tiny-k25-dsv4"])
def test_null_sliding_window_is_refused(checkpoint, copy_checkpoint, tmp_path, preset):
    src = copy_checkpoint(checkpoint(preset))
    config = json.loads((src / "config.json").read_text())
    text = config.get("text_config", config)
    text["sliding_window"] = None
    (src / "config.json").write_text(json.dumps(config))
    for args in (("inspect", src), ("shard", src, tmp_path / "out", "--tp", "1")):
        assert_one_line_error(cli_here(*args), "sliding_window = None", "must be an integer")


def test_requantize_rounds_a_wide_fp4_block(checkpoint, copy_checkpoint, tmp_path):
    """Class 4: a block whose FP4 group scales span more than 14 octaves is refused by `--quant fp8` with a
    message that suggests `--requantize`; under `--requantize` it used to be refused all the same."""
    src = copy_checkpoint(checkpoint("tiny-dsv4-flash"))
    _poke_byte(src, EXPERT_SCALE, 0, 100)  # 2^-27 beside the row's 2^-4 .. 2^-6: 23 octaves in one block
    name = EXPERT_SCALE.replace(".scale", ".weight")
    assert_one_line_error(cli_here("shard", src, tmp_path / "a", "--tp", "1", "--quant", "fp8"),
                          f"tensor {name}", "more than the 14 octaves", "--requantize")
    out = tmp_path / "b"
    p = cli_here("shard", src, out, "--tp", "1", "--quant", "fp8", "--requantize")
    assert p.returncode == 0, p.stderr
    assert cli_here("verify-files", out).returncode == 0
