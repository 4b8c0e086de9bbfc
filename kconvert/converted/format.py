"""The converted checkpoint: the contract between `shard`, the loader and any engine (docs/FORMAT.md).

OUT/
  kconvert.json                      written last, atomically: its presence means complete
  rank-000/globals.safetensors       embed_tokens / final norm / lm_head slices of rank 0
  rank-000/vision.safetensors        vision tower + projector (replicated)
  rank-000/layer-0000.safetensors    decoder layer 0's tensors for rank 0 ...
  config.json, tokenizer files       copied from the source
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

from kconvert.errors import CheckpointError, FormatError
from kconvert.io.pread import read_bytes
from kconvert.io.safetensors_read import read_entry_bytes, read_header

FORMAT = "kconvert"
FORMAT_VERSION = 1
MANIFEST = "kconvert.json"
JOURNAL_DIR = ".kconvert"
CHUNK = 16 * 1024 * 1024
PACK_STATE = "pack.json"  # in JOURNAL_DIR while `kconvert pack` / `unpack` is converting the directory


def stored_bytes(rec: dict) -> int:
    """Bytes on disk of a files[*] record: `bytes` is the plain file's size, `stored.bytes` a compressed one's."""
    return rec["stored"]["bytes"] if rec.get("stored") else rec["bytes"]


def check_not_mid_pack(out: Path) -> None:
    state = Path(out) / JOURNAL_DIR / PACK_STATE
    if state.exists():
        try:
            op = json.loads(state.read_text()).get("op", "pack")
        except (OSError, ValueError):
            op = "pack"
        raise CheckpointError(f"an unfinished `kconvert {op}` is converting this directory; re-run `kconvert {op} "
                              f"{out}` to finish it first", file=str(out))


def unit_file(rank: int, unit: str) -> str:
    """Relative path of one rank's file for a unit ('globals', 'vision' or 'layer-0007')."""
    return f"rank-{rank:03d}/{unit}.safetensors"


def layer_unit(layer: int) -> str:
    return f"layer-{layer:04d}"


def read_manifest(out: str | Path) -> dict:
    path = Path(out) / MANIFEST
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError("no kconvert.json: not a converted checkpoint, or its conversion never finished",
                              file=str(path)) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"kconvert.json is not valid JSON: {e}", file=str(path)) from None
    if meta.get("format") != FORMAT:
        raise CheckpointError("kconvert.json is not a kconvert manifest", file=str(path))
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"format version {meta.get('format_version')} is not the {FORMAT_VERSION} this kconvert "
                              "reads: convert again or use a matching kconvert", file=str(path))
    return meta


def file_crc32(path: Path, size: int) -> str:
    crc, pos = 0, 0
    while pos < size:
        n = min(CHUNK, size - pos)
        crc = zlib.crc32(read_bytes(path, pos, n), crc)
        pos += n
    return f"{crc:08x}"


def verify_files(out: str | Path, progress=None) -> dict:
    """Recompute every file's size and CRC-32 against kconvert.json. Raises on the first damaged file,
    naming the first damaged tensor in it. Returns {"files": n, "bytes": b}."""
    out = Path(out)
    meta = read_manifest(out)
    check_not_mid_pack(out)
    total = 0
    for rel, rec in meta["files"].items():
        path = out / rel
        if not path.is_file():
            raise CheckpointError("listed in kconvert.json but missing", file=str(path))
        size = path.stat().st_size
        if size != stored_bytes(rec):
            raise CheckpointError(f"size {size} differs from the {stored_bytes(rec)} bytes recorded: truncated or "
                                  "replaced", file=str(path))
        if rec.get("stored"):  # compressed: the CRC-32 is of the plain bytes it decompresses to
            comp = read_header(path).compressed
            if comp is None:
                raise CheckpointError("kconvert.json records a compressed shard but the file is plain", file=str(path))
            crc = comp.crc32()
        else:
            crc = file_crc32(path, size)
        if crc != rec["crc32"]:
            raise CheckpointError("checksum mismatch: the file is damaged", file=str(path),
                                  tensor=first_bad_tensor(path, meta, rel))
        total += size
        if progress:
            progress(size)
    return {"files": len(meta["files"]), "bytes": total}


def first_bad_tensor(path: Path, meta: dict, rel: str) -> str | None:
    try:
        header = read_header(path)
    except FormatError:
        return "(header)"
    want = {t["name"]: t["crc32"] for t in meta["tensors"] if t["file"] == rel}
    for entry in sorted(header.tensors.values(), key=lambda e: e.begin):
        try:
            data = read_entry_bytes(entry)
        except FormatError:
            return entry.name
        if f"{zlib.crc32(data):08x}" != want.get(entry.name):
            return entry.name
    return "(header)"
