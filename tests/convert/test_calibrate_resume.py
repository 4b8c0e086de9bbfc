"""Issue 42, class 2: the calibration's resume state (each layer's kept input, OUT/.kconvert/calibration/) is
trusted only as far as a shard is. A kept input scaled by 1.001, zeroed, filled with NaN, cut to half its rows,
swapped with another layer's, truncated, stored as fp16, with another shape or key, replaced by a directory, a
FIFO or a symlink, or beside a stray file: the resumed run recomputes what it cannot trust and writes the bytes
of an uninterrupted run (exit 0), where it used to write other codes or end in an internal error or a hang."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from helpers import shard_job
from kconvert.convert.shard.job import shard

TOKENS, SEQ = 64, 32  # two sequences: a layer in well under a second
SHARED = ("*shared_experts*",)


def _factory():
    from cli.calibrate_opts import calibration_factory

    return calibration_factory("stdlib", TOKENS, SEQ, 0, "kconvert", ("kconvert",))


def _shard(src: Path, out: Path):
    return shard(shard_job(src, out, tp=1, quant="int4", force=SHARED, workers=1), calibrate=_factory())


def _files(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("layer-*.safetensors"))}


@pytest.fixture(scope="module")
def runs(checkpoint, tmp_path_factory):
    """(source, an uninterrupted run's files, a run stopped while calibrating layer 2 with the inputs of layers
    1 and 2 kept)."""
    from engine.calibrate import layerwise

    src = checkpoint("tiny-k25-dsv32")
    root = tmp_path_factory.mktemp("resume")
    whole = _files(Path(_shard(src, root / "whole").out))
    calibrate, done_before = layerwise.LayerCalibration._calibrate, layerwise.LayerCalibration.done_before

    def stop_at_2(self, L):
        if L == 2:
            raise KeyboardInterrupt
        return calibrate(self, L)

    layerwise.LayerCalibration._calibrate = stop_at_2
    layerwise.LayerCalibration.done_before = lambda self, L: None  # keep layer 1's input too (for the swap)
    try:
        with pytest.raises(KeyboardInterrupt):
            _shard(src, root / "stopped")
    finally:
        layerwise.LayerCalibration._calibrate, layerwise.LayerCalibration.done_before = calibrate, done_before
    state = root / "stopped" / ".kconvert" / "calibration"
    assert sorted(p.name for p in state.iterdir()) == ["input-0001.safetensors", "input-0002.safetensors"]
    return src, whole, root / "stopped"


def _rewrite(f: Path, change) -> None:
    """f's tensor changed by `change(x) -> {name: tensor}`, its metadata (layer, digest) kept as it was."""
    from safetensors import safe_open

    with safe_open(str(f), "pt") as g:
        x, meta = g.get_tensor("x"), g.metadata()
    f.unlink()
    save_file(change(x), str(f), metadata=meta)


def _swap(state: Path) -> None:
    shutil.copyfile(state / "input-0001.safetensors", state / "input-0002.safetensors")


def _outside(state: Path) -> None:
    target = state.parent.parent.parent / "elsewhere.safetensors"
    shutil.copyfile(state / "input-0002.safetensors", target)
    (state / "input-0002.safetensors").unlink()
    (state / "input-0002.safetensors").symlink_to(target)


def _as(kind: str):
    def damage(state: Path) -> None:
        f = state / "input-0002.safetensors"
        f.unlink()
        if kind == "fifo":
            os.mkfifo(f)
        else:
            f.mkdir()
            (f / "x").write_text("not a tensor")
    return damage


DAMAGE = {  # what the resume must not trust, and the layers it then recomputes
    "scaled by 1.001": (lambda s: _rewrite(s / "input-0002.safetensors", lambda x: {"x": x * 1.001}), [1, 2]),
    "zeroed": (lambda s: _rewrite(s / "input-0002.safetensors", lambda x: {"x": torch.zeros_like(x)}), [1, 2]),
    "NaN": (lambda s: _rewrite(s / "input-0002.safetensors", lambda x: {"x": torch.full_like(x, float("nan"))}), [1, 2]),
    "half the rows": (lambda s: _rewrite(s / "input-0002.safetensors", lambda x: {"x": x[: len(x) // 2].clone()}), [1, 2]),
    "fp16": (lambda s: _rewrite(s / "input-0002.safetensors", lambda x: {"x": x.half()}), [1, 2]),
    "another key": (lambda s: _rewrite(s / "input-0002.safetensors", lambda x: {"y": x}), [1, 2]),
    "another shape": (lambda s: _rewrite(s / "input-0002.safetensors", lambda x: {"x": x.reshape(1, -1, x.shape[-1])}), [1, 2]),
    "truncated": (lambda s: os.truncate(s / "input-0002.safetensors", 1000), [1, 2]),
    "swapped with layer 1's": (_swap, [1, 2]),
    "a FIFO": (_as("fifo"), [1, 2]),
    "a directory": (_as("dir"), [1, 2]),
    "a symlink out": (_outside, [1, 2]),
    "a stray input-abc": (lambda s: (s / "input-abc.safetensors").write_bytes(b"junk"), [2]),
    "nothing": (lambda s: None, [2]),
}


@pytest.mark.parametrize("what", list(DAMAGE))
def test_damaged_resume_state_is_recomputed_to_the_same_bytes(runs, tmp_path, what):
    src, whole, stopped = runs
    out = tmp_path / "out"
    shutil.copytree(stopped, out, symlinks=True)
    damage, recomputed = DAMAGE[what]
    damage(out / ".kconvert" / "calibration")
    r = _shard(src, out)
    assert [f["layer"] for f in r.details.calibration["layers"]] == recomputed, what
    assert _files(out) == whole, what
    if what == "a symlink out":
        assert (tmp_path / "elsewhere.safetensors").is_file()  # the link went, never what it pointed at
