"""Integrity of a converted directory's files: recompute sizes and CRC-32s against kconvert.json and
name the first damaged file and tensor (`kconvert verify-files`, `load --verify`, pack/unpack)."""

from __future__ import annotations

import stat
from operator import attrgetter, itemgetter
from pathlib import Path

from kconvert.errors import ChecksumMismatch, CheckpointError, FormatError, MissingFileError, UsageError
from kconvert.io.crc import crc32
from kconvert.io.gc_pause import frozen_gc, paused_gc
from kconvert.io.pread import read_bytes
from kconvert.io.regular import kind_of
from kconvert.io.safetensors_read import read_entry_bytes, read_header
from kconvert.disk_format.catalog import MANIFEST, Catalog
from kconvert.disk_format.journal import check_not_mid_pack
from kconvert.disk_format.rank_tensors import COLUMNS
from kconvert.disk_format.units import unit_file

CHUNK = 16 * 1024 * 1024


def file_crc32(path: Path, size: int) -> str:
    crc, pos = 0, 0
    while pos < size:
        n = min(CHUNK, size - pos)
        crc = crc32(read_bytes(path, pos, n), crc)
        pos += n
    return f"{crc:08x}"


def check_size(path: Path, rec: dict, error: type[CheckpointError] = CheckpointError) -> int:
    """The file's size on disk, after checking it is there with the size kconvert.json records
    (`error`: the type to raise, e.g. the loader's LoaderError)."""
    try:
        st = path.stat()
    except OSError:
        raise (MissingFileError if error is CheckpointError else error)("listed in kconvert.json but missing",
                                                                        file=str(path)) from None
    if not stat.S_ISREG(st.st_mode):  # a FIFO would block its reader: named for what it is
        raise error(f"is {kind_of(st.st_mode)}, not a regular file", file=str(path))
    size = st.st_size
    want = Catalog.stored_bytes(rec)
    if size != want:
        raise error(f"size {size} differs from the {want} bytes kconvert.json records: truncated or replaced",
                              file=str(path))
    return size


def by_file(cat: Catalog, ranks: list[int] | None = None) -> dict[str, list]:
    """Every file's tensor rows (rank_tensors.COLUMNS, for check_rows; one pass over the rank lists, not one per
    file); `ranks`: only those ranks' files, reading only their lists (a rank out of range: a UsageError)."""
    for r in ranks or ():
        if not 0 <= r < cat.world_size:
            raise UsageError(f"--rank {r}: this conversion has ranks 0..{cat.world_size - 1}",
                             file=str(Path(cat.root or ".") / MANIFEST))
    files = cat.files if ranks is None else [rel for rel, rec in cat.files.items() if rec["rank"] in ranks]
    out: dict[str, list] = {rel: [] for rel in files}
    for rank in range(cat.world_size) if ranks is None else sorted(set(ranks)):
        for row in cat.rank_rows(rank):
            out.setdefault(unit_file(rank, row[_UNIT]), []).append(row)
    return out


def check_listed(path: Path, header, records: list[dict], error: type[CheckpointError] = CheckpointError) -> None:
    """A shard's header against its rank list's rows for it: the same tensors, each listed once, with the dtype and
    shape the list records. Every byte of a list is covered by kconvert.json's digest, but a list rewritten together
    with its digests, or a shard swapped for another, must not be read by rows that do not describe it."""
    names = set()
    for t in records:
        if t["name"] in names:
            raise error("listed twice in its rank's tensor list", file=str(path), tensor=t["name"])
        names.add(t["name"])
        e = header.tensors.get(t["name"])
        if e is None:
            raise error("tensor listed in kconvert.json is missing from the shard", file=str(path), tensor=t["name"])
        if e.dtype != t["dtype"] or list(e.shape) != t["shape"]:
            raise error(f"stored as {e.dtype}{list(e.shape)}, kconvert.json says {t['dtype']}{t['shape']}",
                        file=str(path), tensor=t["name"])
    if len(header.tensors) != len(names):
        extra = next(n for n in header.tensors if n not in names)
        raise error("in the shard but not in its rank's tensor list", file=str(path), tensor=extra)


def check_rows(path: Path, header, rows: list, error: type[CheckpointError] = CheckpointError) -> None:
    """check_listed over rows of a rank list (Catalog.rank_rows: the loader's, no record a tensor), a column at a
    time; a file they do not all describe is walked by check_listed, which names the tensor."""
    names = list(map(_NAME, rows))
    entries = list(map(header.tensors.get, names))
    if len(set(names)) == len(names) == len(header.tensors) and None not in entries \
            and list(map(_E_DTYPE, entries)) == list(map(_DTYPE, rows)) \
            and list(map(list, map(_E_SHAPE, entries))) == list(map(list, map(_SHAPE, rows))):
        return
    check_listed(path, header, [dict(zip(COLUMNS, row)) for row in rows], error)


_NAME, _DTYPE, _SHAPE = (itemgetter(COLUMNS.index(c)) for c in ("name", "dtype", "shape"))  # of a row
_UNIT = COLUMNS.index("unit")
_E_DTYPE, _E_SHAPE = attrgetter("dtype"), attrgetter("shape")  # of a header entry


def check_headers(out: Path, cat: Catalog) -> None:
    """check_listed for every file of a converted directory (headers only: no tensor data read)."""
    listed = by_file(cat)
    for rel, rec in cat.files.items():
        path = cat.path_of(out, rel)
        check_size(path, rec)
        check_rows(path, read_header(path), listed[rel])


def verify_files(out: str | Path, progress=None, ranks: list[int] | None = None) -> dict:
    """Recompute every file's size and CRC-32 against kconvert.json (`ranks`: only those ranks' files, reading only
    their tensor lists: a node checks its own share). Raises on the first damaged file, naming the first damaged
    tensor in it. Returns {"files": n, "bytes": b}."""
    out = Path(out)
    cat = Catalog.read(out)
    check_not_mid_pack(out)
    with paused_gc():
        listed = by_file(cat, ranks)  # the tensor lists read, each against its sha256 in kconvert.json
    with frozen_gc():  # their rows (500k+ at Kimi K3's topology) out of the walks of the collections reading makes
        return _verify_listed(out, cat, listed, progress)


def _verify_listed(out: Path, cat: Catalog, listed: dict[str, list], progress) -> dict:
    total = 0
    for rel in listed:
        rec = cat.files[rel]
        path = cat.path_of(out, rel)
        size = check_size(path, rec)
        header = read_header(path)
        check_rows(path, header, listed[rel])
        if rec.get("stored"):  # compressed: the CRC-32 is of the plain bytes it decompresses to
            comp = header.compressed
            if comp is None:
                raise CheckpointError("kconvert.json records a compressed shard but the file is plain", file=str(path))
            crc = comp.crc32()
        else:
            crc = file_crc32(path, size)
        if crc != rec["crc32"]:
            raise ChecksumMismatch("checksum mismatch: the file is damaged", file=str(path),
                                   tensor=first_bad_tensor(path, cat, rel))
        total += size
        if progress:
            progress(size)
    return {"files": len(listed), "bytes": total}


def first_bad_tensor(path: Path, cat: Catalog, rel: str) -> str | None:
    try:
        header = read_header(path)
    except FormatError:
        return "(header)"
    want = {t["name"]: t["crc32"] for t in cat.tensors_in(rel)}
    for entry in sorted(header.tensors.values(), key=lambda e: e.begin):
        try:
            data = read_entry_bytes(entry)
        except FormatError:
            return entry.name
        if f"{crc32(data):08x}" != want.get(entry.name):
            return entry.name
    return "(header)"
