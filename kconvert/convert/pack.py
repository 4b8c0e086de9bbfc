"""`kconvert pack OUT` / `kconvert unpack OUT`: convert a converted directory in place between plain and
compressed shards (docs/FORMAT.md, "Compressed shards"), file by file, streaming, resumable.

Each file is rewritten through a temporary name (fsync, rename) after its plain CRC-32 is checked
against kconvert.json; finished files are journalled in OUT/.kconvert/ (with pack.json naming the
operation, which also makes the loader refuse the half-converted directory). kconvert.json is
rewritten once at the end, with `files[*].stored` added (pack) or removed (unpack); the journal is
removed last. unpack(pack(x)) is byte-identical to x, kconvert.json included.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from kconvert.errors import ChecksumMismatch
from kconvert.io.compress_file import compress_file, decompress_file
from kconvert.io.compressed import DEFAULT_LEVEL
from kconvert.converted.format import JOURNAL_DIR, MANIFEST, PACK_STATE, first_bad_tensor, file_crc32, read_manifest
from kconvert.errors import CheckpointError, UsageError
from kconvert.io.safetensors_read import read_header
from kconvert.io.atomic import write_atomic

LOG = "pack-done.jsonl"


@dataclass
class PackResult:
    out: str
    op: str
    files: int = 0  # files converted by this run
    resumed: int = 0  # already converted by an interrupted run
    untouched: int = 0  # already in the target form before we started
    plain_bytes: int = 0  # of the files converted
    stored_bytes: int = 0  # their size afterwards
    seconds: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)


def pack(out: str | Path, *, level: int = DEFAULT_LEVEL, threads: int | None = None, progress=None) -> PackResult:
    """Compress every plain shard of converted directory `out` in place."""
    return _convert(Path(out), "pack", level, threads, progress)


def unpack(out: str | Path, *, threads: int | None = None, progress=None) -> PackResult:
    """Decompress every compressed shard of converted directory `out` in place."""
    return _convert(Path(out), "unpack", None, threads, progress)


def _convert(out: Path, op: str, level: int | None, threads: int | None, progress) -> PackResult:
    t0 = time.perf_counter()
    threads = threads or min(8, os.cpu_count() or 1)
    meta = read_manifest(out)
    journal = out / JOURNAL_DIR
    state = journal / PACK_STATE
    if state.exists():
        prev = json.loads(state.read_text())
        if prev.get("op") != op:
            raise UsageError(f"an unfinished `kconvert {prev.get('op')}` is converting this directory; re-run "
                             f"`kconvert {prev.get('op')} {out}` first", file=str(out))
        level = prev.get("level", level)
    elif journal.exists():
        raise UsageError("the directory holds an unfinished conversion journal; finish `kconvert shard` first",
                         file=str(out))
    result = PackResult(str(out), op)
    want_stored = op == "pack"
    todo = [rel for rel, rec in meta["files"].items() if bool(rec.get("stored")) != want_stored]
    result.untouched = len(meta["files"]) - len(todo)
    if not todo:
        shutil.rmtree(journal, ignore_errors=True)
        result.seconds = time.perf_counter() - t0
        return result
    journal.mkdir(exist_ok=True)
    if not state.exists():
        write_atomic(state, json.dumps({"op": op, "level": level}).encode())
    done = _read_log(journal / LOG, out)
    if progress:
        progress("start", total=sum(meta["files"][rel]["bytes"] for rel in todo))
    advance = (lambda n: progress("advance", n=n)) if progress else None
    with open(journal / LOG, "a") as log:
        for rel in todo:
            rec = meta["files"][rel]
            if rel in done:
                result.resumed += 1
                if progress:
                    progress("advance", n=rec["bytes"])
                continue
            stored = _convert_one(out, rel, rec, meta, op, level, threads, advance)
            log.write(json.dumps({"file": rel, "stored": stored}) + "\n")
            log.flush()
            os.fsync(log.fileno())
            done[rel] = stored
            result.files += 1
            if progress:
                progress("file", path=rel)
    for rel in todo:
        rec = meta["files"][rel]
        result.plain_bytes += rec["bytes"]
        if want_stored:
            rec["stored"] = done[rel]
            result.stored_bytes += done[rel]["bytes"]
        else:
            rec.pop("stored", None)
            result.stored_bytes += rec["bytes"]
    write_atomic(out / MANIFEST, json.dumps(meta, indent=1).encode())
    shutil.rmtree(journal, ignore_errors=True)
    result.seconds = time.perf_counter() - t0
    return result


def _convert_one(out: Path, rel: str, rec: dict, meta: dict, op: str, level: int | None, threads: int,
                 advance) -> dict | None:
    path = out / rel
    if not path.is_file():
        raise CheckpointError("listed in kconvert.json but missing", file=str(path))
    header = read_header(path)
    try:
        if op == "pack":
            if header.compressed is not None:  # renamed into place by a run killed before it journalled the file
                if header.compressed.crc32(threads) != rec["crc32"]:
                    raise ChecksumMismatch("checksum mismatch: the uncompressed bytes differ from kconvert.json",
                                           file=str(path))
                if advance:
                    advance(rec["bytes"])
                return {"codec": "zstd", "level": header.compressed.level, "bytes": header.stored_size}
            return compress_file(path, path, level=level, threads=threads, expect_crc32=rec["crc32"],
                                 progress=advance).record()
        if header.compressed is None:  # unpack: already plain (killed after its rename)
            if file_crc32(path, header.size) != rec["crc32"]:
                raise ChecksumMismatch("checksum mismatch: the file differs from kconvert.json", file=str(path))
            if advance:
                advance(rec["bytes"])
            return None
        decompress_file(path, path, threads=threads, expect_crc32=rec["crc32"], progress=advance)
        return None
    except ChecksumMismatch as e:
        e.tensor = first_bad_tensor(path, meta, rel)
        raise


def _read_log(log: Path, out: Path) -> dict[str, dict | None]:
    done: dict[str, dict | None] = {}
    if not log.exists():
        return done
    for line in log.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn last line: that file is redone
        path = out / rec["file"]
        stored = rec.get("stored")
        if path.is_file() and (stored is None or path.stat().st_size == stored["bytes"]):
            done[rec["file"]] = stored
    return done
