"""Shared test fixtures: real-format tiny checkpoints, built once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from kconvert.fixtures import kernels

kernels.pin()  # before any test imports torch: the trained fixtures' bytes, and the floors measured on them, are the
# same on an AVX-512 machine as on an AVX2 one (kconvert/fixtures/kernels.py)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint("tiny-k25-dsv32") -> Path of a freshly generated checkpoint (cached for the session).

    checkpoint("tiny-k25-dsv32-trained") / checkpoint("tiny-dsv32-trained") train their shared text model
    once per session (about 2 minutes on 2 cores; kconvert/fixtures/training/text.py caches it in-process).

    Tests that damage a checkpoint must copy it first (see `copy_checkpoint`)."""
    from kconvert.fixtures import build_fixture

    built: dict[tuple, Path] = {}

    def get(preset: str, **kwargs) -> Path:
        key = (preset, tuple(sorted(kwargs.items())))
        if key not in built:
            out = tmp_path_factory.mktemp(preset.replace("-", "_")) / preset
            built[key] = build_fixture(preset, out, **kwargs)
        return built[key]

    return get


@pytest.fixture(scope="session")
def conversion(checkpoint, tmp_path_factory):
    """conversion("tiny-k25-dsv32", tp=2, quant="fp8") -> Path of `shard` of that preset with those ShardJob
    options, converted once per session and shared by every test module that asks for the same one (a family's
    tests pay for each conversion once). Read-only: a test that damages one copies it first (copy_checkpoint)."""
    from helpers import shard_job
    from kconvert.convert.shard.job import shard

    built: dict[tuple, Path] = {}

    def get(preset: str, **job) -> Path:
        key = (preset, tuple(sorted(job.items())))
        if key not in built:
            name = "-".join([preset] + [f"{k}{v}" for k, v in sorted(job.items())])
            out = tmp_path_factory.mktemp("conversion") / name
            built[key] = Path(shard(shard_job(checkpoint(preset), out, **job)).out)
        return built[key]

    return get


@pytest.fixture
def copy_checkpoint(tmp_path):
    """copy_checkpoint(src) -> a private copy under tmp_path that a test may damage."""
    import shutil

    def copy(src: Path) -> Path:
        dst = tmp_path / (Path(src).name + "-copy")
        shutil.copytree(src, dst)
        return dst

    return copy


@pytest.fixture(scope="session")
def image_file(tmp_path_factory):
    """A small PNG (a yellow disk on blue) for the chat tests with an image."""
    from PIL import Image, ImageDraw

    im = Image.new("RGB", (120, 90), (30, 60, 200))
    ImageDraw.Draw(im).ellipse((20, 10, 90, 80), fill=(250, 200, 20))
    path = tmp_path_factory.mktemp("img") / "disk.png"
    im.save(path)
    return path


class _Hang(Exception):
    pass


@pytest.fixture
def deadline():
    """Fail a case that hangs (a FIFO would) after 30 s instead of hanging the suite."""
    import signal

    def hang(signum, frame):
        raise _Hang("no answer within 30 s")

    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(30)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)
