"""The filesystem's own CPU cost of a conversion's files, replayed beside it (bench only, not CI): what
metadata_bench.py's shard rows say of their overhead that is neither data nor kconvert's Python (on this session's
machine it moved between runs: 339 to 737 µs of CPU a file)."""

from __future__ import annotations

import os
import resource
import shutil
from pathlib import Path


def files_cost(out: Path) -> tuple[float, int]:
    """The filesystem's own CPU cost of the files a conversion in `out` made, replayed beside it: for each of its
    files a hidden temporary created in a folder per rank, 4 KiB written, fsynced and renamed into place, each
    folder fsynced once per unit, as shard does, then removed. (CPU s of this process over the replay, files)."""
    files = sorted(out.rglob("*.safetensors"), key=lambda f: (f.name, str(f.parent)))  # unit by unit, as written
    replay = out.with_name(out.name + "-fs")
    shutil.rmtree(replay, ignore_errors=True)
    dirs = sorted({f.parent.relative_to(out) for f in files})
    for d in dirs:
        (replay / d).mkdir(parents=True)
    block = b"\0" * 4096
    used = resource.getrusage(resource.RUSAGE_SELF)
    for i, f in enumerate(files):
        final = replay / f.relative_to(out)
        tmp = final.with_name(f".{final.name}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, block)
        os.fsync(fd)
        os.close(fd)
        os.replace(tmp, final)
        if (i + 1) % len(dirs) == 0 or i + 1 == len(files):  # a unit's files, one a rank: each folder once
            for d in dirs:
                fd = os.open(replay / d, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
    now = resource.getrusage(resource.RUSAGE_SELF)
    shutil.rmtree(replay, ignore_errors=True)
    return now.ru_utime + now.ru_stime - used.ru_utime - used.ru_stime, len(files)
