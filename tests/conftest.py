"""Shared test fixtures: real-format tiny checkpoints and their conversions, built once per test run and shared by
the workers of `pytest -n` (how `make test` runs)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
from pathlib import Path

import pytest

from kconvert.fixtures import kernels

kernels.pin()  # before any test imports torch: the trained fixtures' bytes, and the floors measured on them, are the
# same on an AVX-512 machine as on an AVX2 one (kconvert/fixtures/kernels.py)


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory) -> Path:
    """A folder shared by every process of this test run: pytest-xdist's workers each have their own basetemp under
    the run's, so the run's is their parent; a run without workers has its own basetemp."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session", autouse=True)
def fixture_cache(run_dir):
    """Trainings cached on disk for the whole run (kconvert/fixtures/training/disk_cache.py): the CLI processes tests
    start and the other workers read what one process trained."""
    from kconvert.fixtures.training.disk_cache import ENV

    old = os.environ.get(ENV)
    os.environ[ENV] = str(run_dir / "trainings")
    yield
    if old is None:
        os.environ.pop(ENV, None)
    else:
        os.environ[ENV] = old


@contextlib.contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        yield


def _once(run_dir: Path, kind: str, key: tuple, make) -> Path:
    """`make(out)`'s directory for `key`, made once per run: the first process to ask builds it under a lock, the
    others (pytest-xdist's workers) wait and share it."""
    name = f"{key[0]}-{hashlib.sha256(repr(key).encode()).hexdigest()[:12]}"
    out = run_dir / kind / name / key[0]
    with _locked(run_dir / kind / f"{name}.lock"):
        if not (out.parent / "done").exists():
            shutil.rmtree(out.parent, ignore_errors=True)
            out.parent.mkdir(parents=True)
            make(out)
            (out.parent / "done").touch()
    return out


@pytest.fixture(scope="session")
def checkpoint(run_dir):
    """checkpoint("tiny-k25-dsv32") -> Path of a freshly generated checkpoint, built once per test run and shared by
    every worker process (the trained presets take minutes: tiny-k25-dsv32-trained and tiny-dsv32-trained share one
    training, cached on disk by kconvert/fixtures/training/disk_cache.py).

    Tests that damage a checkpoint must copy it first (see `copy_checkpoint`)."""
    from kconvert.fixtures import build_fixture

    built: dict[tuple, Path] = {}

    def get(preset: str, **kwargs) -> Path:
        key = (preset, tuple(sorted(kwargs.items())))
        if key not in built:
            built[key] = _once(run_dir, "checkpoints", key, lambda out: build_fixture(preset, out, **kwargs))
        return built[key]

    return get


@pytest.fixture(scope="session")
def conversion(checkpoint, run_dir):
    """conversion("tiny-k25-dsv32", tp=2, quant="fp8") -> Path of `shard` of that preset with those ShardJob
    options, converted once per test run and shared by every test module (and worker) that asks for the same one
    (a family's tests pay for each conversion once). Read-only: a test that damages one copies it first
    (copy_checkpoint)."""
    from helpers import shard_job
    from kconvert.convert.shard.job import shard

    built: dict[tuple, Path] = {}

    def get(preset: str, **job) -> Path:
        key = (preset, tuple(sorted(job.items())))
        if key not in built:
            src = checkpoint(preset)
            built[key] = _once(run_dir, "conversions", key, lambda out: shard(shard_job(src, out, **job)))
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
