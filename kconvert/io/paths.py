"""The one containment rule for every path a checkpoint names (kconvert.json, index.json, side files):
a plain relative path that stays inside its directory — no absolute path, no `..`, no symlink leading out."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kconvert.errors import CheckpointError


def contained(root: str | Path, rel: object, *, named_in: str | Path, tensor: str | None = None) -> Path:
    """`root / rel`, after checking that `rel` (as read from the file `named_in`, for `tensor` if given) is a
    plain relative path resolving inside `root`. Raises CheckpointError naming `named_in` otherwise."""
    parts = _plain_relative(rel, named_in, tensor)
    root = Path(root)
    path = root.joinpath(*parts)
    # os.path on strings, not Path.resolve: a converted directory lists hundreds of files, checked on every open
    root_real = os.path.realpath(root)
    if _plain_below(root_real, parts):  # no part of rel is a symlink: inside (what realpath would find, in 1 stat
        return path  # a part rather than one for every part of the whole path; a loader opens 100s of files)
    real = os.path.realpath(path)
    allowed = [root_real]
    if os.path.basename(os.path.dirname(root_real)) == "snapshots":  # a Hub cache snapshot: files link to ../../blobs
        allowed.append(os.path.dirname(os.path.dirname(root_real)))
    if not any(real == a or real.startswith(a.rstrip(os.sep) + os.sep) for a in allowed):
        raise CheckpointError(f"{rel!r} is a symlink leading out of the checkpoint directory", file=str(named_in),
                              tensor=tensor)
    return path


def side_file(root: str | Path, name: str) -> Path | None:
    """root/name, a file beside a checkpoint (tokenizer, templates, token maps), through `contained`; None where the
    checkpoint has no such file (a dangling symlink is present, and refused if it leads out)."""
    path = Path(root) / name
    if not os.path.lexists(path):
        return None
    return contained(root, name, named_in=path)


def contained_all(root: str | Path, rels, *, named_in: str | Path) -> None:
    """`contained` for every name in `rels` (kconvert.json lists every rank's files, checked on each open): one
    directory listing a folder says which entries are symlinks, so a plain name costs no system call of its own;
    a name with a symlink among its parts (or a folder that cannot be listed) gets `contained`'s full answer."""
    links: dict[str, set[str] | None] = {}  # folder below root ("" for root) -> its entries that are symlinks

    def symlinks_in(folder: str) -> set[str] | None:
        if folder not in links:
            try:
                with os.scandir(os.path.join(root, folder) if folder else root) as entries:
                    links[folder] = {e.name for e in entries if e.is_symlink()}
            except OSError:
                links[folder] = None
        return links[folder]

    for rel in rels:
        parts = _plain_relative(rel, named_in, None)
        for i, part in enumerate(parts):
            found = symlinks_in("/".join(parts[:i]))
            if found is None or part in found:
                contained(root, rel, named_in=named_in)
                break


def _plain_relative(rel: object, named_in, tensor: str | None) -> tuple[str, ...]:
    """`rel`'s parts, after checking it is a plain relative name: no absolute path, no `..`, no empty part."""
    if not isinstance(rel, str) or not rel or "\x00" in rel or "\\" in rel:
        raise CheckpointError(f"file name {rel!r} is not a plain relative path", file=str(named_in), tensor=tensor)
    parts = rel.split("/")
    plain = tuple(part for part in parts if part != ".")  # "./a/./b" is a/b
    if rel.startswith("/") or any(part in ("..", "") for part in parts) or not plain:
        raise CheckpointError(f"file name {rel!r} leaves the checkpoint directory (absolute or '..')",
                              file=str(named_in), tensor=tensor)
    return plain


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
