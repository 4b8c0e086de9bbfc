"""The one containment rule for every path a checkpoint names (kconvert.json, index.json, side files):
a plain relative path that stays inside its directory — no absolute path, no `..`, no symlink leading out."""

from __future__ import annotations

import os
import stat
from pathlib import Path, PurePosixPath

from kconvert.errors import CheckpointError


def contained(root: str | Path, rel: object, *, named_in: str | Path, tensor: str | None = None) -> Path:
    """`root / rel`, after checking that `rel` (as read from the file `named_in`, for `tensor` if given) is a
    plain relative path resolving inside `root`. Raises CheckpointError naming `named_in` otherwise."""
    if not isinstance(rel, str) or not rel or "\x00" in rel or "\\" in rel:
        raise CheckpointError(f"file name {rel!r} is not a plain relative path", file=str(named_in), tensor=tensor)
    p = PurePosixPath(rel)
    if p.is_absolute() or any(part in ("..", "") for part in rel.split("/")) or p.parts[0] == ".":
        raise CheckpointError(f"file name {rel!r} leaves the checkpoint directory (absolute or '..')",
                              file=str(named_in), tensor=tensor)
    root = Path(root)
    path = root.joinpath(*p.parts)
    # os.path on strings, not Path.resolve: a converted directory lists hundreds of files, checked on every open
    root_real = os.path.realpath(root)
    if _plain_below(root_real, p.parts):  # no part of rel is a symlink: inside (what realpath would find, in 1 stat
        return path  # a part rather than one for every part of the whole path; a loader opens 100s of files)
    real = os.path.realpath(path)
    allowed = [root_real]
    if os.path.basename(os.path.dirname(root_real)) == "snapshots":  # a Hub cache snapshot: files link to ../../blobs
        allowed.append(os.path.dirname(os.path.dirname(root_real)))
    if not any(real == a or real.startswith(a.rstrip(os.sep) + os.sep) for a in allowed):
        raise CheckpointError(f"{rel!r} is a symlink leading out of the checkpoint directory", file=str(named_in),
                              tensor=tensor)
    return path


def _plain_below(root_real: str, parts: tuple[str, ...]) -> bool:
    """Whether every component of `parts` below the resolved root exists and is not a symlink (then the path resolves
    to root_real/parts, inside the root); False sends the caller to realpath's full answer."""
    at = root_real
    for part in parts:
        at = os.path.join(at, part)
        try:
            if stat.S_ISLNK(os.lstat(at).st_mode):
                return False
        except OSError:
            return False
    return True
