"""One writer at a time on a directory: an exclusive, non-blocking flock on the directory itself, held while a
command rewrites files in it. Nothing is created in the directory, and the lock goes with the process (a killed
run leaves none behind). Where the filesystem has no flock (some network mounts), the run goes on unguarded,
as before."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from pathlib import Path

from kconvert.errors import UsageError


@contextlib.contextmanager
def held(path: Path, busy: str):
    """Hold `path`'s lock for the block; UsageError(`busy`, naming `path`) when another process holds it. A path that
    is no directory has nothing to lock: the block runs, and its own reads name what is missing."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    except (FileNotFoundError, NotADirectoryError):
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise UsageError(busy, file=str(path)) from None
            # ENOLCK, EINVAL, EOPNOTSUPP: no locks on this filesystem; unguarded, as before
        yield
    finally:
        os.close(fd)  # releases the lock
