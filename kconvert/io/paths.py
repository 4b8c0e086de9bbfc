"""The one containment rule for every path a checkpoint names (kconvert.json, index.json, side files):
a plain relative path that stays inside its directory — no absolute path, no `..`, no symlink leading out."""

from __future__ import annotations

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
    real = path.resolve()
    allowed = [root.resolve()]
    if root.resolve().parent.name == "snapshots":  # a Hub cache snapshot: its files link to the repo's ../../blobs
        allowed.append(root.resolve().parent.parent)
    if not any(real == a or a in real.parents for a in allowed):
        raise CheckpointError(f"{rel!r} is a symlink leading out of the checkpoint directory", file=str(named_in),
                              tensor=tensor)
    return path
