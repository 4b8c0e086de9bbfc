"""The journal of an unfinished `shard`, `pack` or `unpack` (OUT/.kconvert/): append-only JSON lines,
one per finished file, fsynced, so a killed run resumes where it stopped. A torn last line is ignored
(that file is redone); a record counts only while its file is still there with the recorded size."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path

import msgspec

from kconvert.errors import CheckpointError, KConvertError
from kconvert.io.atomic import write_error
from kconvert.io.compact_json import compact_json
from kconvert.io.side_files import MAX_CONFIG, MAX_TEXT, read_bytes, read_json

JOURNAL_DIR = ".kconvert"
PACK_STATE = "pack.json"  # in JOURNAL_DIR while `kconvert pack` / `unpack` is converting the directory


def _decode(line: bytes, log: Path):
    try:
        return msgspec.json.decode(line)  # (it checks the UTF-8 of what it decodes)
    except msgspec.DecodeError:  # anything it refuses (a torn line, NaN): json.loads decides, as it always has
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError:
            raise CheckpointError("not UTF-8 text", file=str(log)) from None
        return json.loads(text)


def read_done(logs: Iterable[Path], out: Path, size_of: Callable[[dict], int | None],
              recorded: dict[bytes, dict] | None = None) -> dict[str, dict]:
    """{file: record} of every journalled file whose bytes are still there. `size_of(record)` is the size
    the file must have, or None when any size will do. `recorded`: lines this process wrote (JournalLog), each
    with the record it encoded: a line read back byte for byte as written is that record, not decoded again."""
    done: dict[str, dict] = {}
    recorded = recorded or {}
    for log in logs:
        if not log.exists():
            continue
        for line in read_bytes(log, limit=MAX_TEXT).splitlines():  # (not decoded as a whole: msgspec checks each line)
            try:  # msgspec first (a line a file: 250k tensor CRCs in all at a release's size), json.loads for the rest
                rec = recorded.get(line)
                if rec is None:
                    rec = _decode(line, log)
                rel = rec["file"]
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
            if not isinstance(rel, str) or ".." in rel.split("/") or rel.startswith("/"):
                continue
            path = out / rel
            want = size_of(rec)
            if path.is_file() and (want is None or path.stat().st_size == want):
                done[rel] = rec
    return done


class JournalLog:
    """Append records to one journal file, each durable before the next file is started."""

    def __init__(self, path: Path, recorded: dict[bytes, dict] | None = None):
        self.path = path
        self.recorded = recorded  # line -> record, kept for read_done (records of plain JSON values only)
        try:
            self._f = open(path, "ab")
        except OSError as e:
            raise write_error(e, path) from None

    def add(self, record: dict) -> None:
        self.add_all([record])

    def add_all(self, records: list[dict]) -> None:
        """Several records (files made durable together) with one fsync."""
        try:  # a record that is not durable counts as not written: the file is redone on resume
            lines = [compact_json(r) for r in records]
            self._f.write(b"".join(line + b"\n" for line in lines))  # 100k+ tensor CRCs a conversion
            self._f.flush()
            os.fsync(self._f.fileno())
        except OSError as e:
            raise write_error(e, self.path) from None
        if self.recorded is not None:  # durable: what read_done may take it as (a shard's file records: str, int, dict)
            self.recorded.update((line, r) for line, r in zip(lines, records) if _plain(r))

    def close(self) -> None:
        self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_SCALARS = frozenset((str, int, bool, type(None)))


def _plain(value) -> bool:
    """Whether JSON gives `value` back equal and of the same types (no tuple, float or other object in it), checked
    a dict's keys and values a column at a time (a file's record holds its hundreds of tensor CRCs)."""
    if type(value) is not dict:
        return type(value) in _SCALARS
    if not set(map(type, value)) <= {str}:
        return False
    types = set(map(type, value.values()))
    return types <= _SCALARS or (types <= _SCALARS | {dict} and all(_plain(v) for v in value.values() if type(v) is dict))


def check_not_mid_pack(out: Path) -> None:
    state = Path(out) / JOURNAL_DIR / PACK_STATE
    if state.exists():
        op, ranks, _ = pack_state(state)
        op = op if op in ("pack", "unpack") else "pack"
        flags = rank_flags(ranks)
        raise CheckpointError(f"an unfinished `kconvert {op}{flags}` is converting this directory; re-run "
                              f"`kconvert {op} {out}{flags}` to finish it first", file=str(out))


def pack_state(state: Path, op: str = "pack") -> tuple[object, list[int] | None, dict]:
    """What an unfinished pack / unpack's state file (PACK_STATE) records: (its op, `op` where it says none or cannot be
    read; its ranks, None for every rank or a value that is no list of ints; the record itself, {} if unreadable)."""
    try:
        record = read_json(state, limit=MAX_CONFIG)
    except (OSError, KConvertError):
        record = {}
    record = record if isinstance(record, dict) else {}
    ranks = record.get("ranks")
    return record.get("op", op), ranks if isinstance(ranks, list) and all(type(r) is int for r in ranks) else None, record


def rank_flags(ranks: list[int] | None) -> str:
    """` --rank R` for each of `ranks`, as a command line names them (pack / unpack of some ranks' files)."""
    return "".join(f" --rank {r}" for r in ranks or ())
