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


# The compilers' caches a run makes (MLX's CPU kernels in $TMPDIR/mlx/, torch inductor's in
# $TMPDIR/torchinductor_USER/, triton's): kept inside a command's own work directory by `compiler_caches`
CACHE_VARS = ("TMPDIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


@contextlib.contextmanager
def compiler_caches(work: Path):
    """While the block runs, the compilers MLX and torch bring write their caches inside `work` (a work_dir, removed
    with it) instead of leaving mlx/ and torchinductor_root/ in $TMPDIR; spawned ranks inherit the setting. MLX reads
    TMPDIR at each compile, torch the variables when it first compiles. tempfile's own directory (where work_dir makes
    its directories) was fixed before and stays."""
    tempfile.gettempdir()  # fixed now, before TMPDIR moves
    saved = {k: os.environ.get(k) for k in CACHE_VARS}
    os.environ.update({"TMPDIR": str(work), "TORCHINDUCTOR_CACHE_DIR": str(work / "torchinductor"),
                       "TRITON_CACHE_DIR": str(work / "triton")})
    try:
        yield work
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


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


def scrub(e: KConvertError, work: Path, what: str, *, stands_for: tuple[Path, str] | None = None,
          only_if_named: bool = False) -> KConvertError:
    """`e` raised inside `work`, told without the temporary path (nobody can act on it: it is removed) and
    without 'resume' advice (nothing is left to resume). `stands_for` (a directory under `work`, the path it copies):
    a file of the temporary conversion of a source is named as the source's own (its config, its token map).
    `only_if_named`: `e` as it is when it names no temporary path."""
    named = str(work) in e.message or bool(e.file and str(work) in str(e.file))
    if only_if_named and not named:
        return e
    message, file = e.message, e.file
    if stands_for is not None:
        inner, outer = str(stands_for[0]), str(stands_for[1])
        message = message.replace(inner, outer)
        file = str(file).replace(inner, outer) if file else file
    text = re.sub(r"[;,]?\s*(free space and )?re-?run[^;.]*", "", message.replace(str(work), "")).strip(" ;,")
    file = None if file and str(work) in str(file) else file
    out = type(e).__new__(type(e))
    KConvertError.__init__(out, f"{what}: {text}" if text else what, file=file, tensor=e.tensor)
    return out


@contextlib.contextmanager
def unnamed(work: Path, what: str):
    """An error raised in the block that names the temporary `work` (a file verify made there, a reference it ran) is
    told without that path (`scrub`); other errors pass as they are."""
    try:
        yield
    except KConvertError as e:
        raise scrub(e, work, what, only_if_named=True) from None
