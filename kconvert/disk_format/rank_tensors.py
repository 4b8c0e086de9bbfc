"""Each rank's tensor list in a file of its own (format version 4): `rank-RRR/tensors.json`.

A rank loading its units reads kconvert.json (config, layout, files: small) and its own list, never the
others', so its metadata cost does not grow with tp x pp. kconvert.json's `tensors_by_rank[r]` records each
list's file, tensor count and sha256, and the kconvert.json digest covers those records: every byte of
every list is still covered by the one digest, and a list is checked against its sha256 before use.

A list is stored as rows under one `columns` line (no per-tensor key names, no fields its file already
gives: rank, file and layer come from its unit), written compactly; `records()` gives back the same
per-tensor dicts kconvert.json version 3 held inline.
"""

from __future__ import annotations

import hashlib
import json
import re
from itertools import chain
from operator import itemgetter
from pathlib import Path

from kconvert.errors import CheckpointError, MissingFileError
from kconvert.io.atomic import write_atomic
from kconvert.io.compact_json import compact_json
from kconvert.io.dtypes import ITEMSIZE
from kconvert.io.gc_pause import paused_gc
from kconvert.io.paths import contained
from kconvert.io.side_files import MAX_CATALOG, read_bytes
from kconvert.disk_format.units import unit_file, unit_layer

FORMAT = "kconvert-rank-tensors"
_CRC = re.compile(r"[0-9a-f]{8}")
_INT = {int}  # every size an int itself (a bool is an int subclass, and equals 1 in a key)
COLUMNS = ("name", "unit", "group", "component", "expert", "rule", "slice", "transform", "dtype", "shape", "crc32")
ROW = itemgetter(*COLUMNS)  # a record as its row (a tuple: JSON writes it as the list it was)
RECORD_KEYS = ("name", "file", "rank", "layer", "unit", "group", "component", "expert", "rule", "slice", "transform",
               "dtype", "shape", "crc32")  # a full record, as version 3 stored it


def list_file(rank: int) -> str:
    return f"rank-{rank:03d}/tensors.json"


def encode(rank: int, rows: list) -> bytes:
    """Rank `rank`'s list of `rows` (each a COLUMNS tuple or list), compact."""
    return compact_json({"format": FORMAT, "rank": rank, "columns": list(COLUMNS), "tensors": rows}, allow_nan=False)


def split_by_rank(records: list[dict], world_size: int) -> list[list[dict]]:
    lists: list[list[dict]] = [[] for _ in range(world_size)]
    for t in records:
        lists[t["rank"]].append(t)
    return lists


def write_lists(out: Path, records: list[dict], world_size: int) -> list[dict]:
    """Every rank's list from full records (kconvert.json version 3's form)."""
    return write_rows(out, [list(map(ROW, mine)) for mine in split_by_rank(records, world_size)])


def write_rows(out: Path, rows_by_rank: list[list]) -> list[dict]:
    """Write every rank's list of rows (atomically each); return the `tensors_by_rank` records for kconvert.json."""
    index = []
    for rank, rows in enumerate(rows_by_rank):
        raw = encode(rank, rows)
        write_atomic(out / list_file(rank), raw)
        index.append({"file": list_file(rank), "tensors": len(rows), "sha256": hashlib.sha256(raw).hexdigest()})
    return index


def read_list(out: Path, rank: int, entry: dict, files: dict[str, dict]) -> list[dict]:
    """Rank `rank`'s full tensor records, after checking the list's sha256 (kconvert.json's record `entry`)
    and every row (`check_record`)."""
    with paused_gc():  # up to 100k+ records: io/gc_pause.py
        rows, bad = _rows_of(out, rank, entry)
        places: dict = {}  # unit -> (file, layer): a few dozen units for 100k+ rows
        seen: set = set()  # what `check` has found valid already
        return [_record(rank, i, row, files, bad, places, seen) for i, row in enumerate(rows)]


def read_rows(out: Path, rank: int, entry: dict, files: dict[str, dict]) -> list[list]:
    """Rank `rank`'s rows (COLUMNS) as the list holds them, checked as `read_list` checks them, a column at a time:
    what the loader needs (a name, dtype and shape a tensor) without a record built per tensor. A list that fails
    a check is walked row by row, which names the first bad row as `read_list` does."""
    with paused_gc():
        rows, bad = _rows_of(out, rank, entry)
        if not _rows_pass(rank, rows, files):
            return list(map(ROW, (_record(rank, i, row, files, bad, {}, set()) for i, row in enumerate(rows))))
        return rows


def _rows_of(out: Path, rank: int, entry: dict) -> tuple[list, object]:
    """The list's rows after its sha256 and form are checked, and the `bad(field, why)` that names its file."""
    path = contained(out, entry["file"], named_in=Path(out) / "kconvert.json")

    def bad(field: str, why: str):
        raise CheckpointError(f"field {field}: {why} (rank {rank}'s tensor list, listed in kconvert.json)",
                              file=str(path))

    try:  # bounded and regular files only (a FIFO would block the load forever)
        raw = read_bytes(path, limit=MAX_CATALOG)
    except MissingFileError:
        raise CheckpointError(f"rank {rank}'s tensor list, listed in kconvert.json, is missing", file=str(path)) from None
    if hashlib.sha256(raw).hexdigest() != entry["sha256"]:
        raise CheckpointError(f"rank {rank}'s tensor list was changed after kconvert.json was written (its sha256 "
                              "does not match kconvert.json's tensors_by_rank): convert again", file=str(path))
    try:
        doc = json.loads(raw)
    except RecursionError:  # shallower nesting fails the row checks below
        raise CheckpointError(f"rank {rank}'s tensor list is JSON nested too deep", file=str(path)) from None
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError, a number past Python's digit limit
        raise CheckpointError(f"rank {rank}'s tensor list is not valid JSON ({_short(e)})", file=str(path)) from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("rank") != rank \
            or doc.get("columns") != list(COLUMNS) or not isinstance(doc.get("tensors"), list):
        bad("format", f"not rank {rank}'s {FORMAT} list with columns {', '.join(COLUMNS)}")
    return doc["tensors"], bad


def _rows_pass(rank: int, rows: list, files: dict[str, dict]) -> bool:
    """Whether every row passes what `_record` checks of it, found a column at a time (each distinct shape, slice
    and unit once)."""
    if not rows:
        return True
    try:
        if set(map(type, rows)) != {list} or set(map(len, rows)) != {len(COLUMNS)}:
            return False
        names, units, _, _, _, _, slices, _, dtypes, shapes, crcs = zip(*rows)
        if set(map(type, names)) != {str} or set(map(type, crcs)) != {str} or not all(map(_CRC.fullmatch, crcs)) \
                or not set(dtypes) <= ITEMSIZE.keys() or set(map(type, shapes)) != {list} \
                or not set(map(type, slices)) <= {list, type(None)} or set(map(type, units)) != {str}:
            return False
        cuts = [sl for sl in slices if sl is not None]
        # every size an int itself, each row's own (a set of shapes would keep [1, 2] for a later [true, 2])
        if not _INT.issuperset(map(type, chain.from_iterable(shapes))) \
                or not _INT.issuperset(map(type, chain.from_iterable(cuts))) or set(map(len, cuts)) - {3}:
            return False
        if min(map(min, filter(None, set(map(tuple, shapes)))), default=0) < 0:
            return False
        for unit in set(units):
            unit_layer(unit)
            if unit_file(rank, unit) not in files:
                return False
    except (TypeError, ValueError):  # an unhashable dtype, shape member or slice; a unit that names no unit
        return False
    return True


def _short(e: Exception) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= 120 else text[:117] + "..."


def _record(rank: int, i: int, row, files: dict[str, dict], bad, places: dict, seen: set) -> dict:
    if not isinstance(row, list) or len(row) != len(COLUMNS):
        bad(f"tensors[{i}]", f"not a row of {len(COLUMNS)} columns")
    name, unit, group, component, expert, rule, sl, transform, dtype, shape, crc = row
    place = places.get(unit) if isinstance(unit, str) else None
    if place is None:
        try:
            layer = unit_layer(unit)
        except ValueError:
            bad(f"tensors[{i}].unit", f"{unit!r} is not a unit name")
        if unit_file(rank, unit) not in files:
            bad(f"tensors[{i}].unit", f"rank {rank} has no file for unit {unit!r}")
        place = places[unit] = (unit_file(rank, unit), layer)
    t = {"name": name, "file": place[0], "rank": rank, "layer": place[1], "unit": unit, "group": group,
         "component": component, "expert": expert, "rule": rule, "slice": sl, "transform": transform,
         "dtype": dtype, "shape": shape, "crc32": crc}  # RECORD_KEYS, in order
    check_record(f"tensors[{i}]", t, bad, None, seen)
    return t


def check_record(f: str, t: dict, bad, rec: dict | None = None, seen: set | None = None) -> None:
    """One tensor record (`rec`: its file's record, when the caller has not placed it already). `seen`: the
    (dtype, shape, slice) triples already found valid, so 100k records check those once per distinct triple."""
    key = None
    if seen is not None:
        key = _key(t)
        if rec is None and key is not None and _seen(t, key, seen):
            return
    if not isinstance(t.get("name"), str):
        bad(f, "not a tensor record with a name")
    if rec is not None and (t.get("rank") != rec["rank"] or t.get("unit") != rec["unit"]):
        bad(f, f"rank/unit of tensor {t['name']} differ from its file's")
    if t.get("dtype") not in ITEMSIZE:
        bad(f"{f}.dtype", f"{t.get('dtype')!r} is not a safetensors dtype")
    shape = t.get("shape")
    if not isinstance(shape, list) or not all(_int(s) and s >= 0 for s in shape):
        bad(f"{f}.shape", f"{shape!r} is not a list of sizes")
    sl = t.get("slice")
    if sl is not None and (not isinstance(sl, list) or len(sl) != 3 or not all(_int(s) for s in sl)):
        bad(f"{f}.slice", f"{sl!r} is not [dim, start, stop]")
    if not isinstance(t.get("crc32"), str) or not _CRC.fullmatch(t["crc32"]):
        bad(f"{f}.crc32", "not an 8-digit hex CRC-32")
    if key is not None:
        seen.add(key)


def known(t: dict, seen: set) -> bool:
    """Whether record `t` is like one check_record found valid (`seen`), its name and CRC well-formed: then it
    passes check_record (given its file's rank and unit) without the field-by-field checks."""
    key = _key(t)
    return key is not None and _seen(t, key, seen)


def _key(t: dict) -> tuple | None:
    try:
        sl = t.get("slice")
        return t.get("dtype"), type(t.get("shape")), tuple(t.get("shape")), type(sl), sl and tuple(sl)
    except TypeError:  # not lists of plain values: check_record names what is wrong
        return None


def _seen(t: dict, key: tuple, seen: set) -> bool:
    try:
        return key in seen and type(t.get("name")) is str and type(t.get("crc32")) is str \
            and bool(_CRC.fullmatch(t["crc32"])) and _INT.issuperset(map(type, key[2] + (key[4] or ())))
    except TypeError:  # an unhashable slice or shape member
        return False  # (a bool equals 1 as a key: the type test keeps [true] from passing as [1])


def _int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_index(index, world_size: int, bad) -> None:
    """kconvert.json's `tensors_by_rank`: one {file, tensors, sha256} record per rank, each at its rank's path."""
    if not isinstance(index, list) or len(index) != world_size:
        bad("tensors_by_rank", f"not a list of {world_size} records (one per rank)")
    for r, e in enumerate(index):
        if not isinstance(e, dict) or e.get("file") != list_file(r) or not isinstance(e.get("sha256"), str) \
                or not isinstance(e.get("tensors"), int):
            bad(f"tensors_by_rank[{r}]", f"not a {{file: {list_file(r)!r}, tensors, sha256}} record")


__all__ = ["COLUMNS", "check_index", "check_record", "list_file", "read_list", "read_rows", "write_lists"]
