"""The one way kconvert opens a file for reading: regular files only, never blocking.

Every reader (safetensors headers and data, compressed shards, rank lists, side files, journals, resume
state, calibration data, images) opens through `open_regular` or `regular_fd`, and a test
(tests/tree/test_architecture.py) fails on any other read-only open below cli/. Why: a FIFO opened for reading
blocks until a writer comes (forever), so the file is opened with O_NONBLOCK and its type is checked with
fstat on that same descriptor before anything reads it (no race with a rename in between); a character
device that reads like /dev/zero never ends; a directory or a socket is not data. Each refusal is the
caller's KConvertError class, one line naming the file; a missing file is MissingFileError (also a
FileNotFoundError). Byte limits are the callers' (io/side_files.py for whole-file reads)."""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from kconvert.errors import CheckpointError, KConvertError, MissingFileError

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def kind_of(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def open_regular(path: str | os.PathLike, error: type[KConvertError] = CheckpointError) -> tuple[int, int]:
    """(fd, size) of `path` opened read-only, after checking on the descriptor that it is a regular file. The
    caller closes fd."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise MissingFileError("not found", file=str(path)) from None
    except OSError as e:  # EACCES, ELOOP, ENAMETOOLONG, ENOTDIR ...
        raise error(f"cannot be opened ({e.strerror or e})", file=str(path)) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"is {kind_of(st.st_mode)}, not a regular file", file=str(path))
        os.set_blocking(fd, True)  # a regular file: reads behave as they always do
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


@contextlib.contextmanager
def regular_fd(path: str | os.PathLike, error: type[KConvertError] = CheckpointError):
    """`with regular_fd(path) as (fd, size):` open_regular's descriptor, closed at the end of the block."""
    fd, size = open_regular(path, error)
    try:
        yield fd, size
    finally:
        os.close(fd)


def regular_file(path: str | os.PathLike, error: type[KConvertError] = CheckpointError):
    """A binary file object over open_regular's descriptor, for a library that reads a file object (Pillow)."""
    fd, _ = open_regular(Path(path), error)
    return os.fdopen(fd, "rb")
