"""Issue 28: what is left after a run ends, however it ends. Temporary work is removed on every way out and
reclaimed after a SIGKILL; a stopped rank is noticed; a wrong --nproc starts nothing; a rank's files swapped
with others of the same size are caught on their first load."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from kconvert.io import workdir


@pytest.fixture
def work_base(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    yield tmp_path / workdir.BASE_NAME
    tempfile.tempdir = None


def test_work_dir_removed_on_error_and_on_sigterm(work_base):
    with pytest.raises(RuntimeError):
        with workdir.work_dir("verify") as d:
            (d / "big").write_bytes(b"x" * 100)
            raise RuntimeError("boom")
    assert not d.exists()
    with pytest.raises(KeyboardInterrupt):
        with workdir.terminate_as_interrupt(), workdir.work_dir("verify") as d:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler interrupts this at once
    assert not d.exists() and list(work_base.iterdir()) == []


def test_work_dir_of_a_killed_process_reclaimed(work_base):
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    stale = work_base / f"verify-{p.pid}-abc123"
    stale.mkdir(parents=True)
    mine = work_base / f"verify-{os.getpid()}-live12"  # a live process's: kept
    mine.mkdir()
    p.kill()
    p.wait()
    with workdir.work_dir("verify"):
        pass
    assert not stale.exists() and mine.exists()


def test_scrubbed_error_names_no_temp_path(tmp_path):
    from kconvert.errors import DiskFullError

    e = DiskFullError("disk full while writing; free space and re-run the same command to resume",
                      file=str(tmp_path / "converted" / "rank-000.safetensors"))
    out = workdir.scrub(e, tmp_path, "resharding the export for verify")
    assert isinstance(out, DiskFullError) and str(tmp_path) not in out.one_line() and "re-run" not in out.one_line()


def test_stopped_rank_is_noticed():
    from kconvert.distributed import StoppedWatch

    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        watch = StoppedWatch(limit_s=0.2)
        assert watch.frozen({1: p.pid}) is None
        os.kill(p.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while watch.frozen({1: p.pid}) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert watch.frozen({1: p.pid}) == 1
    finally:
        p.kill()
        p.wait()


@pytest.fixture(scope="module")
def tp2(conversion):
    return conversion("tiny-k25-dsv32", tp=2)


def test_wrong_nproc_starts_nothing(tp2):
    from engine.chat import session as chat

    before = set(os.listdir("/proc"))
    assert chat.main([str(tp2), "--nproc", "8", "--prompt", "hi"]) == 2
    assert chat.main([str(tp2), "--nproc", "1000", "--prompt", "hi"]) == 2
    children = [p for p in set(os.listdir("/proc")) - before if p.isdigit() and _parent(p) == os.getpid()]
    assert children == []


def _parent(pid: str) -> int:
    try:
        stat = open(f"/proc/{pid}/stat", "rb").read()
    except OSError:
        return -1
    return int(stat[stat.rfind(b")") + 2:].split()[1])


def test_swapped_rank_files_caught_on_first_load(tp2, tmp_path, monkeypatch):
    from kconvert.errors import LoaderError
    from kconvert.load.first_load import needs_crc
    from kconvert.load.loader import open_converted

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    out = tmp_path / "tp2"
    shutil.copytree(tp2, out)
    conv = open_converted(out, rank=0, world_size=2)
    assert needs_crc(conv)
    for _ in conv.stream(verify="first"):
        pass
    assert not needs_crc(open_converted(out, rank=0, world_size=2))  # checked once: not again
    a, b = sorted(out.glob("rank-000/layer-*.safetensors"))[0], sorted(out.glob("rank-001/layer-*.safetensors"))[0]
    assert a.stat().st_size == b.stat().st_size
    tmp = a.with_suffix(".swap")
    a.rename(tmp), b.rename(a), tmp.rename(b)
    conv = open_converted(out, rank=0, world_size=2)
    assert needs_crc(conv)
    with pytest.raises(LoaderError, match="checksum"):
        for _ in conv.stream(verify="first"):
            pass
