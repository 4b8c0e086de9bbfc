"""Crash-safe writes: a file is either absent, its old self or complete (temp + fsync + rename + fsync dir);
an OSError becomes a WriteError (also an OSError) naming the file; disk full stays resumable."""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path

from kconvert.errors import DiskFullError, WriteError


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_error(e: OSError, path: Path) -> WriteError:
    """An OSError while writing `path` as a one-line WriteError (EACCES, EIO, ...; disk full: DiskFullError)."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):  # EFBIG: a file-size limit (ulimit -f)
        return DiskFullError("disk full while writing; free space and re-run the same command to resume", file=str(path))
    return WriteError(f"cannot write: {e.strerror}", file=str(path))


@contextlib.contextmanager
def atomic_file(path: Path, tag: str = ""):
    """Write `path` through a hidden temporary beside it: on success fsync, rename into place and
    fsync the directory; on any error remove the temporary, so `path` is never half-written."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}{tag}")
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise write_error(e, path) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_atomic(path: Path, data: bytes) -> None:
    """Small files (kconvert.json, journal snapshots)."""
    with atomic_file(path) as f:
        f.write(data)
