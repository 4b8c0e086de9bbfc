"""`kconvert pack OUT` / `kconvert unpack OUT`: convert a converted directory in place between plain and
compressed shards (docs/FORMAT.md, "Compressed shards"), file by file, streaming, resumable.

Each file is rewritten through a temporary name (fsync, rename) after its plain CRC-32 is checked
against kconvert.json; finished files are journalled in OUT/.kconvert/ (with pack.json naming the
operation, which also makes the loader refuse the half-converted directory). kconvert.json is
rewritten once at the end, with `files[*].stored` added (pack) or removed (unpack); the journal is
removed last (the run's skeleton: run.py). unpack(pack(x)) is byte-identical to x, kconvert.json included.
A damaged file (its CRC-32, header or presence) does not stop the others: it is left as it was, the rest is
finished and recorded, and the run ends with one line naming it and the ways out (restore it and re-run, or
the opposite command to roll back), so the directory never stays half-converted because of one file.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from kconvert.errors import CheckpointError, ChecksumMismatch, KConvertError, UsageError
from kconvert.io.atomic import fsync_dir, write_error
from kconvert.io.compress_file import compress_file, decompress_file
from kconvert.io.compressed import DEFAULT_LEVEL
from kconvert.io.dir_lock import held
from kconvert.io.safetensors_read import read_header
from kconvert.disk_format.catalog import Catalog
from kconvert.disk_format.integrity import by_file, check_rows, check_size, file_crc32, first_bad_tensor
from kconvert.disk_format.journal import JOURNAL_DIR, PACK_STATE, pack_state, rank_flags
from kconvert.convert.run import PackFigures, Run, RunResult

LOG = "pack-done.jsonl"


def pack(out: str | Path, *, level: int = DEFAULT_LEVEL, threads: int | None = None, progress=None,
         ranks: list[int] | None = None) -> RunResult:
    """Compress every plain shard of converted directory `out` in place (`ranks`: only those ranks' files)."""
    return _convert(Path(out), "pack", level, threads, progress, ranks)


def unpack(out: str | Path, *, threads: int | None = None, progress=None, ranks: list[int] | None = None) -> RunResult:
    """Decompress every compressed shard of converted directory `out` in place (`ranks`: only those ranks' files)."""
    return _convert(Path(out), "unpack", None, threads, progress, ranks)


def _convert(out: Path, op: str, level: int | None, threads: int | None, progress, ranks: list[int] | None) -> RunResult:
    # one pack or unpack at a time on a directory, whichever ranks: a second one (another shell, the same node's
    # job started twice) would convert the same files beside it and rewrite kconvert.json under it
    with held(out, "another `kconvert pack` or `unpack` is converting this directory now; wait for it to end"):
        return _convert_held(out, op, level, threads, progress, ranks)


def _convert_held(out: Path, op: str, level: int | None, threads: int | None, progress,
                  ranks: list[int] | None) -> RunResult:
    run = Run(out, progress, logs=LOG, details=PackFigures(op))
    result = run.result
    threads = threads or min(8, os.cpu_count() or 1)
    cat = Catalog.read(out)
    ranks = sorted(set(ranks)) if ranks else None
    # the tensor lists of every rank converted, each checked against its sha256 before kconvert.json is rewritten
    # over them (another rank's list is not read: a node packs its own share, and its list stays as it was)
    listed = by_file(cat, ranks)
    journal = out / JOURNAL_DIR
    state = journal / PACK_STATE
    if state.exists():
        level = _resumed(out, state, op, ranks, level)
    elif journal.exists():
        raise UsageError("the directory holds an unfinished conversion journal; finish `kconvert shard` first",
                         file=str(out))
    want_stored = op == "pack"
    todo = [rel for rel in listed if bool(cat.files[rel].get("stored")) != want_stored]
    result.details.untouched = len(listed) - len(todo)
    if not todo:
        shutil.rmtree(journal, ignore_errors=True)
        result.already_complete = True
        return _pack_names(run.done())
    _writable(out, op)
    try:
        journal.mkdir(exist_ok=True)
    except OSError as e:
        raise _read_only(out, op, e) from None
    if not state.exists() and not _claim(state, {"op": op, "level": level, **({"ranks": ranks} if ranks else {})}):
        level = _resumed(out, state, op, ranks, level)  # another process started one at the same moment
    done = run.journalled(_journalled_size)
    run.start(sum(cat.files[rel]["bytes"] for rel in todo))
    advance = (lambda n: progress("working", n=n)) if progress else None  # in flight; counted when durable
    damaged: list[tuple[str, KConvertError]] = []  # files left as they were: the others still convert
    with run.log(LOG) as log:
        for rel in todo:
            rec = cat.files[rel]
            if rel in done:
                result.files_resumed += 1
                if progress:
                    progress("advance", n=rec["bytes"])
                continue
            try:
                stored = _convert_one(out, rel, rec, cat, op, level, threads, advance, listed[rel])
            except CheckpointError as e:  # this file's own damage (a write error stops the run: it resumes)
                damaged.append((rel, e))
                continue
            log.add({"file": rel, "stored": stored})
            run.wrote(rel, durable_bytes=rec["bytes"])
    converted = [rel for rel in todo if rel not in dict(damaged)]

    def rewrite_catalog(journalled: dict) -> None:  # every converted file, as the journal recorded it
        for rel in converted:
            rec = cat.files[rel]
            result.bytes_in += rec["bytes"]
            if want_stored:
                rec["stored"] = journalled[rel]["stored"]
                result.bytes_out += rec["stored"]["bytes"]
            else:
                rec.pop("stored", None)
                result.bytes_out += rec["bytes"]
        cat.write(out)

    run.finish(converted, _journalled_size, rewrite_catalog)
    if damaged:
        raise _left_as_it_was(out, op, damaged, len(converted), ranks)
    return _pack_names(run.done())


def _command(op: str, out: Path, ranks: list[int] | None) -> str:
    return f"kconvert {op} {out}{rank_flags(ranks)}"


def _resumed(out: Path, state: Path, op: str, ranks: list[int] | None, level: int | None) -> int | None:
    """The level of the unfinished run `state` records, when it is this one (the same op over the same ranks: a
    resume); else a UsageError naming the command that finishes it. Two nodes packing their own ranks of one shared
    directory at once: the second is told to wait for the first, not let to rewrite kconvert.json beside it."""
    prev_op, prev_ranks, prev = pack_state(state, op)
    if prev_op != op or prev_ranks != ranks:
        raise UsageError(f"an unfinished `kconvert {prev_op}{rank_flags(prev_ranks)}` is converting this "
                         f"directory; re-run `{_command(prev_op, out, prev_ranks)}` first", file=str(out))
    return prev.get("level", level)


def _writable(out: Path, op: str) -> None:
    """Refuse, before any file is touched, a directory this process cannot write: a read-only mount or permissions
    (pack and unpack rewrite the shards in place and keep their journal in OUT/.kconvert/)."""
    if not os.access(out, os.W_OK | os.X_OK):
        raise _read_only(out, op, None)


def _read_only(out: Path, op: str, e: OSError | None) -> UsageError:
    why = f" ({e.strerror})" if e is not None and e.strerror else ""
    return UsageError(f"the directory is not writable{why}: `kconvert {op}` rewrites its shards in place; run it where "
                      "the directory can be written (or copy it there)", file=str(out))


def _claim(state: Path, record: dict) -> bool:
    """Write the run's state file, durable, unless one is there already (another process's): False then. Linked into
    place from a temporary, so it is either absent or whole, and only one of two processes starting at once gets it."""
    tmp = state.with_name(f".{state.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:  # private to this process until linked: written and fsynced in place
            f.write(json.dumps(record).encode())
            f.flush()
            os.fsync(f.fileno())
        os.link(tmp, state)
    except FileExistsError:
        return False
    except OSError as e:
        raise write_error(e, state) from None
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(state.parent)
    return True


def _left_as_it_was(out: Path, op: str, damaged: list[tuple[str, KConvertError]], converted: int,
                    ranks: list[int] | None) -> KConvertError:
    """The first damaged file's error, saying what was done and the ways out. The directory is consistent:
    kconvert.json records every file in the form it has now (the damaged ones unchanged), so every read that
    does not touch them works, `verify-files` names them, and the opposite command rolls the rest back."""
    rel, e = damaged[0]
    more = f" (and {len(damaged) - 1} more damaged files)" if len(damaged) > 1 else ""
    undo = "unpack" if op == "pack" else "pack"
    e.message = (f"{e.message}{more}; {op} left it as it was and finished the other {converted} files: restore it "
                 f"(from a copy, or convert the source again) and re-run `{_command(op, out, ranks)}`, or roll back "
                 f"with `{_command(undo, out, ranks)}`")
    return e


def _pack_names(result: RunResult) -> RunResult:
    """The names `kconvert pack --json` has always printed, beside the common ones: files converted by
    this run, resumed, plain bytes of the files converted and their size afterwards."""
    figures = result.details
    figures.files, figures.resumed = result.files_written, result.files_resumed
    figures.plain_bytes, figures.stored_bytes = result.bytes_in, result.bytes_out
    return result


def _convert_one(out: Path, rel: str, rec: dict, cat: Catalog, op: str, level: int | None, threads: int,
                 advance, listed: list) -> dict | None:
    path = cat.path_of(out, rel)
    if not path.is_file():
        check_size(path, rec)  # names the missing file
    header = read_header(path)
    check_rows(path, header, listed)  # rows that do not describe the file: damage, as a bad CRC is
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
        e.tensor = first_bad_tensor(path, cat, rel)
        raise


def _journalled_size(rec: dict) -> int | None:
    """A packed file must have the size its journal line records; an unpacked one any size (its CRC is
    checked again when kconvert.json is next verified)."""
    stored = rec.get("stored")
    return stored.get("bytes") if isinstance(stored, dict) else None
