"""A rank's tensor list read as rows (Catalog.rank_rows, the loader's read: no record a tensor) is checked as the
records are: a clean list gives the same tensors, and each kind of damage to any one row fails with the same
one-line error, naming the same row and field, as `read_list` gives (the columnar check hands a list it cannot
vouch for to the row-by-row walk). The shard-vs-list check over rows (`check_rows`) names what `check_listed` does."""

from __future__ import annotations

import hashlib
import json
import random

import pytest

from kconvert.disk_format import rank_tensors
from kconvert.disk_format.catalog import Catalog
from kconvert.disk_format.integrity import check_listed, check_rows
from kconvert.errors import CheckpointError
from kconvert.io.safetensors_read import read_header

NAME, UNIT, SLICE, DTYPE, SHAPE, CRC = (rank_tensors.COLUMNS.index(c) for c in
                                        ("name", "unit", "slice", "dtype", "shape", "crc32"))
DAMAGES = {
    "name not a string": lambda r: r.__setitem__(NAME, 5),
    "unknown dtype": lambda r: r.__setitem__(DTYPE, "F9"),
    "negative size": lambda r: r.__setitem__(SHAPE, [2, -1]),
    "a bool size": lambda r: r.__setitem__(SHAPE, [True, 2]),
    "a bool size like another row's": lambda r: r.__setitem__(SHAPE, [True] + r[SHAPE][1:]),
    "shape not a list": lambda r: r.__setitem__(SHAPE, "x"),
    "unhashable size": lambda r: r.__setitem__(SHAPE, [[1], 2]),
    "slice of two": lambda r: r.__setitem__(SLICE, [0, 1]),
    "empty slice": lambda r: r.__setitem__(SLICE, []),
    "a bool in the slice": lambda r: r.__setitem__(SLICE, [0, 1, False]),
    "upper-case crc": lambda r: r.__setitem__(CRC, "ABCDEF01"),
    "crc not a string": lambda r: r.__setitem__(CRC, 5),
    "unit without a file": lambda r: r.__setitem__(UNIT, "layer-9999"),
    "no unit name": lambda r: r.__setitem__(UNIT, "nonsense"),
    "unit not a string": lambda r: r.__setitem__(UNIT, 3),
    "a column more": lambda r: r.append(1),
    "not a row": lambda r: r.clear(),
}


@pytest.fixture(scope="module")
def conv(conversion):
    return conversion("tiny-k25-dsv32", tp=2, quant="fp8")


def _written(tmp_path, cat: Catalog, doc: dict) -> tuple[dict, object]:
    """`doc` as rank 1's list in a folder of its own: (its tensors_by_rank entry, the folder)."""
    raw = json.dumps(doc).encode()
    (tmp_path / "rank-001").mkdir(exist_ok=True)
    (tmp_path / rank_tensors.list_file(1)).write_bytes(raw)
    return {"file": rank_tensors.list_file(1), "sha256": hashlib.sha256(raw).hexdigest()}, tmp_path


def _error(fn) -> str:
    with pytest.raises(CheckpointError) as e:
        fn()
    return str(e.value)


def test_clean_rows_are_the_records_rows(conv):
    cat = Catalog.read(conv)
    for rank in range(cat.world_size):
        rows = Catalog.read(conv).rank_rows(rank)
        assert [list(r) for r in rows] == [list(rank_tensors.ROW(t)) for t in cat.rank_tensors(rank)] and rows


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_row_fails_as_the_records_do(conv, tmp_path, damage):
    cat = Catalog.read(conv)
    doc = json.loads((conv / rank_tensors.list_file(1)).read_text())
    i = random.Random(damage).randrange(len(doc["tensors"]))
    DAMAGES[damage](doc["tensors"][i])
    entry, root = _written(tmp_path, cat, doc)
    want = _error(lambda: rank_tensors.read_list(root, 1, entry, cat.files))
    assert f"tensors[{i}]" in want
    assert _error(lambda: rank_tensors.read_rows(root, 1, entry, cat.files)) == want


def test_check_rows_names_what_check_listed_names(conv):
    cat = Catalog.read(conv)
    rel = next(rel for rel, rec in cat.files.items() if rec["rank"] == 1 and rec["unit"] != "globals")
    path, header = cat.path_of(conv, rel), read_header(cat.path_of(conv, rel))
    rows = [list(r) for r in cat.rank_rows(1) if r[UNIT] == cat.files[rel]["unit"]]
    check_rows(path, header, rows)  # a clean file passes
    for damage in (lambda rs: rs.append(list(rs[0])),  # listed twice
                   lambda rs: rs.pop(),  # a shard tensor not listed
                   lambda rs: rs[1].__setitem__(NAME, "nowhere"),  # listed, not in the shard
                   lambda rs: rs[2].__setitem__(DTYPE, "F32" if rs[2][DTYPE] != "F32" else "BF16"),
                   lambda rs: rs[3].__setitem__(SHAPE, rs[3][SHAPE] + [1])):
        bad = [list(r) for r in rows]
        damage(bad)
        want = _error(lambda: check_listed(path, header, [dict(zip(rank_tensors.COLUMNS, r)) for r in bad]))
        assert _error(lambda: check_rows(path, header, bad)) == want
