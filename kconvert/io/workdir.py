"""Temporary work that cleans up after itself on every way out, and after a SIGKILL on the next run.

All of it lives under one directory, $TMPDIR/kconvert-work/, as `PREFIX-PID-RANDOM` (verify's reshard of an
export is as large as the conversion, its references and results are per prompt). `work_dir()` removes its
directory on return, on an exception and on Ctrl-C; `terminate_as_interrupt()` turns SIGTERM into the same
Ctrl-C path (Python's default SIGTERM ends the process without running cleanup); a directory whose process
is gone (SIGKILL, power loss) is removed by the next `work_dir()`. A message never shows these paths:
`scrub()` takes them out of an error raised inside."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import tempfile
import threading
from pathlib import Path

from kconvert.errors import KConvertError

BASE_NAME = "kconvert-work"
_NAME = re.compile(r".+-(\d+)-[A-Za-z0-9_]+")


def base_dir() -> Path:
    return Path(tempfile.gettempdir()) / BASE_NAME


@contextlib.contextmanager
def work_dir(prefix: str):
    """A fresh directory under base_dir(), removed however the block ends; stale ones are reclaimed first."""
    base = base_dir()
    base.mkdir(mode=0o700, exist_ok=True)
    reclaim(base)
    path = Path(tempfile.mkdtemp(prefix=f"{prefix}-{os.getpid()}-", dir=base))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def reclaim(base: Path) -> list[Path]:
    """Remove the work directories of processes that no longer exist (this user's; others are left)."""
    gone = []
    for d in base.iterdir() if base.is_dir() else ():
        m = _NAME.fullmatch(d.name)
        if m and d.is_dir() and not _alive(int(m.group(1))):
            shutil.rmtree(d, ignore_errors=True)
            gone.append(d)
    return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive, and not ours to judge
        return True
    return True


@contextlib.contextmanager
def terminate_as_interrupt():
    """While the block runs (in the main thread), SIGTERM raises KeyboardInterrupt, so every `finally` and
    `with` on the way out runs: temporary work is removed and spawned ranks are stopped."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def scrub(e: KConvertError, work: Path, what: str) -> KConvertError:
    """`e` raised inside `work`, told without the temporary path (nobody can act on it: it is removed) and
    without 'resume' advice (nothing is left to resume)."""
    text = re.sub(r"[;,]?\s*(free space and )?re-?run[^;.]*", "", e.message.replace(str(work), "")).strip(" ;,")
    file = None if e.file and str(work) in str(e.file) else e.file
    out = type(e).__new__(type(e))
    KConvertError.__init__(out, f"{what}: {text}" if text else what, file=file, tensor=e.tensor)
    return out
