"""Fault injection on the write side: a full disk and failing fsyncs are one-line errors (WriteError,
also an OSError) that leave no temporary and no kconvert.json, and the same command resumes; a file
is journalled only after its bytes, its rename and its directory are durable."""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from faults import MANIFEST, convert
from helpers import ROOT
from helpers import shard_job
from kconvert.convert.shard.job import shard
from kconvert.disk_format.integrity import verify_files
from kconvert.errors import WriteError


def _file_size_limit(limit: int):
    def apply() -> None:  # in the child, before exec: ignored signals stay ignored across exec
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def test_disk_full_is_a_clean_error_and_resumable(checkpoint, tmp_path):
    src = checkpoint("tiny-dsv32")
    ref = tmp_path / "ref"
    assert convert(src, ref) is None
    sizes = {rel: rec["bytes"] for rel, rec in json.loads((ref / MANIFEST).read_text())["files"].items()}
    first = [rel for rel in sizes if rel.endswith(("globals.safetensors", "layer-0000.safetensors"))]
    limit = max(sizes[rel] for rel in first)  # the first two units fit; the MoE layers after them do not
    assert limit < min(v for rel, v in sizes.items() if rel not in first)
    shutil.rmtree(ref)
    out = tmp_path / "out"
    args = [sys.executable, "-m", "cli.main", "shard", str(src), str(out), "--tp", "2", "--quant", "fp8"]
    r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300,
                       preexec_fn=_file_size_limit(limit), env=os.environ.copy())
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr and "layer-0001.safetensors" in lines[0], r.stderr
    assert "disk full" in lines[0] and "re-run" in lines[0], lines[0]  # the message says it resumes
    assert not (out / MANIFEST).exists()
    assert not list(out.rglob(".*.tmp-*")), "a temporary file was left behind"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    again = shard(shard_job(src, out, tp=2, quant="fp8"))  # the same job, no limit: it resumes and finishes
    assert again.files_resumed == len(first) and again.files_written == len(sizes) - len(first)
    verify_files(out)


# ------------------------------------------------------------- the fsync policy (workers never fsync)


def _trace_durability(monkeypatch) -> list[tuple]:
    """Record, in order, every fsync (by the path its descriptor names), rename and journal append."""
    import threading

    from kconvert.disk_format.journal import JournalLog

    events: list[tuple] = []
    lock = threading.Lock()
    real_fsync, real_replace, real_add = os.fsync, os.replace, JournalLog.add_all

    def fsync(fd):
        real_fsync(fd)
        with lock:
            events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))

    def replace(a, b):
        real_replace(a, b)
        with lock:
            events.append(("rename", str(a), str(b)))

    def add_all(self, records):
        with lock:
            events.append(("journal", [r["file"] for r in records]))
        real_add(self, records)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(JournalLog, "add_all", add_all)
    return events


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to name a descriptor's file")
def test_a_file_is_journalled_only_after_fsync_rename_and_directory_fsync(checkpoint, tmp_path, monkeypatch):
    """Workers write units without waiting for the disk; what makes a unit durable moved to the thread
    that journals. The resume guarantee needs, for every journalled file, in this order: its bytes
    fsynced (under the temporary name), the rename to the final name, its directory fsynced, and only
    then the journal line that lets a re-run skip it."""
    events = _trace_durability(monkeypatch)
    out = (tmp_path / "out").resolve()
    assert convert(checkpoint("tiny-dsv32"), out, tp=2) is None
    journalled = [(i, rel) for i, e in enumerate(events) if e[0] == "journal" for rel in e[1]]
    assert len(journalled) == len(json.loads((out / MANIFEST).read_text())["files"])
    for at, rel in journalled:
        final = out / rel
        renames = [i for i, e in enumerate(events[:at]) if e[0] == "rename" and e[2] == str(final)]
        assert renames, f"{rel} journalled before it was renamed into place"
        tmp = Path([e for e in events if e[0] == "rename" and e[2] == str(final)][0][1])
        assert tmp.name.startswith(f".{final.name}.tmp-")
        synced = [i for i, e in enumerate(events[:renames[-1]]) if e == ("fsync", str(tmp))]
        assert synced, f"{rel} renamed into place before its bytes were fsynced"
        dir_synced = [i for i in range(renames[-1], at) if events[i] == ("fsync", str(final.parent))]
        assert dir_synced, f"{rel} journalled before its directory entry was fsynced"


def test_fsync_failure_journals_none_of_the_unit_and_resumes(checkpoint, tmp_path, monkeypatch):
    """A unit whose fsync fails (the disk reports an I/O error) is not journalled, leaves no temporary
    and no kconvert.json; units made durable before it are kept, and the same command resumes to the
    same bytes as an uninterrupted run."""
    src = checkpoint("tiny-dsv32")
    ref, out = tmp_path / "ref", tmp_path / "out"
    assert convert(src, ref, tp=2) is None
    real_fsync = os.fsync

    def failing(fd):
        if ".layer-0001.safetensors.tmp-" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", failing)
    err = convert(src, out, tp=2)
    assert err is not None and "layer-0001.safetensors" in err.one_line() and "cannot write" in err.one_line()
    assert isinstance(err, WriteError) and isinstance(err, OSError), type(err)  # `except OSError` catches it
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert not (out / MANIFEST).exists()
    assert not list(out.rglob(".*.tmp-*")), "a temporary file was left behind"
    lines = "".join(p.read_text() for p in (out / ".kconvert").glob("done-*.jsonl"))
    kept = [json.loads(line)["file"] for line in lines.splitlines()]
    assert kept and not any("layer-0001" in rel for rel in kept)
    stale = [out / "rank-000" / ".layer-0001.safetensors.tmp-4242", out / "rank-001" / ".layer-0001.safetensors.tmp-7"]
    for f in stale:  # what a killed run would have left of the files still to write
        f.write_bytes(b"torn")
    again = shard(shard_job(src, out, tp=2, quant="fp8"))
    assert again.files_resumed == len(kept)
    assert not any(f.exists() for f in stale) and not list(out.rglob(".*.tmp-*"))
    verify_files(out)
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*.safetensors")} == \
        {p.relative_to(ref): p.read_bytes() for p in ref.rglob("*.safetensors")}


@pytest.mark.parametrize("where", ["writer", "atomic"])
def test_unwritable_file_is_a_write_error_naming_it(tmp_path, monkeypatch, where):
    """EACCES on a file being written (a shard, or a small file written atomically) is a WriteError: one
    line naming the file, caught by `except OSError` as the error types promise, no temporary left."""
    import torch

    from kconvert.io.atomic import write_atomic
    from kconvert.io.safetensors_write import SafetensorsWriter

    real_open = os.open

    def denied(path, *a, **k):
        if ".tmp-" in str(path):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, *a, **k)

    monkeypatch.setattr(os, "open", denied)
    target = tmp_path / "x.safetensors"
    with pytest.raises(OSError) as info:
        if where == "writer":
            SafetensorsWriter(target, [("w", "F32", (2,))]).write("w", torch.zeros(2))
        else:
            monkeypatch.setattr("builtins.open", lambda path, *a, **k: denied(path))
            write_atomic(target, b"{}")
    assert isinstance(info.value, WriteError) and info.value.exit_code == 2
    assert info.value.one_line() == f"{target}: cannot write: Permission denied"
    assert list(tmp_path.iterdir()) == []


def test_journal_fsync_failure_is_a_write_error_naming_the_journal(tmp_path, monkeypatch):
    """EIO while making a journal record durable is a WriteError naming the journal (exit 2, one line),
    not a raw OSError that ends as an internal error."""
    from kconvert.disk_format.journal import JournalLog

    def eio(fd):
        raise OSError(errno.EIO, "Input/output error")

    log = JournalLog(tmp_path / "done-0000.jsonl")
    monkeypatch.setattr(os, "fsync", eio)
    with pytest.raises(WriteError) as info:
        log.add({"file": "rank-000/globals.safetensors"})
    assert info.value.one_line() == f"{tmp_path / 'done-0000.jsonl'}: cannot write: Input/output error"
