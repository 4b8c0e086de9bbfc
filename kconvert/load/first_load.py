"""CRC-32s checked on the first load of each rank's files, not on every load.

Sizes and headers are checked on every load, but two rank files of the same size swapped (or a file
rewritten in place) pass those checks and would be served. A full CRC pass costs about as much as reading
the files once more from the page cache, so it is paid once: after a load that checked every file of a
rank, each file's identity (device, inode, size, mtime, ctime) is stamped in the user's cache
($XDG_CACHE_HOME/kconvert/verified/); a later load checks CRCs again only when any of them changed
(a rename, a copy, an edit). The stamp lives outside OUT, which may be read-only."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from kconvert.io.side_files import MAX_CONFIG, read_json

STAMP_VERSION = 1


def _stamp_path(conv) -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kconvert" / "verified"
    key = f"{Path(conv.root).resolve()}|{conv.meta.get('digest')}|{conv.rank}"
    return base / (hashlib.sha256(key.encode()).hexdigest()[:32] + ".json")


def _identity(conv) -> dict[str, list[int]]:
    out = {}
    for rel in sorted(conv.files):
        try:
            st = os.stat(conv.catalog.path_of(conv.root, rel))
        except OSError:
            return {}
        out[rel] = [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
    return out


def needs_crc(conv) -> bool:
    """Whether this rank's files were never CRC-checked as they are now (so this load must check them)."""
    ident = _identity(conv)
    try:  # a stamp that is not a small regular JSON file (a FIFO, a device, deep JSON) counts as none
        stamp = read_json(_stamp_path(conv), limit=MAX_CONFIG)
    except (OSError, ValueError):
        return True
    return not ident or stamp != {"version": STAMP_VERSION, "files": ident}


def mark_checked(conv) -> None:
    """Record that every file of this rank passed its CRC check (best effort: a cache we cannot write only
    means the next load checks again)."""
    ident = _identity(conv)
    if not ident:
        return
    path = _stamp_path(conv)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps({"version": STAMP_VERSION, "files": ident}))
        os.replace(tmp, path)
    except OSError:
        pass
