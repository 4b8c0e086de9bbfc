"""kconvert.json, the catalog of a converted directory: its one owner. It is built by `shard`, updated
by `pack`/`unpack` and read by the loader, verify-files and verify, always through `Catalog`.

What it guarantees on read: the JSON parses, the format and version are ours, the digest over the
whole document matches (so an edited config, layout or tensor list is refused, not loaded), the schema
holds (types, tp >= 1, every rank has exactly one file per unit, every tensor lies in a listed file of
its rank) and every file name stays inside the directory (kconvert.io.paths). See docs/FORMAT.md."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from kconvert.errors import CheckpointError
from kconvert.io.atomic import write_atomic
from kconvert.io.dtypes import DTYPES
from kconvert.io.paths import contained
from kconvert.converted.units import is_unit, unit_file, unit_layer

FORMAT = "kconvert"
FORMAT_VERSION = 2  # 2: adds `digest`; version 1 directories are refused with "convert again"
MANIFEST = "kconvert.json"
SCHEMES = ("none", "fp8", "int8", "int4")
_CRC = re.compile(r"[0-9a-f]{8}")


def digest_of(doc: dict) -> str:
    """sha256 over the canonical JSON of everything but the digest itself."""
    body = {k: v for k, v in doc.items() if k != "digest"}
    canon = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return "sha256:" + hashlib.sha256(canon.encode()).hexdigest()


@dataclass
class Catalog:
    doc: dict  # the kconvert.json document (validated; mutate only through methods that re-validate)

    # ------------------------------------------------------------------ reading
    @classmethod
    def read(cls, out: str | Path) -> "Catalog":
        path = Path(out) / MANIFEST
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raise CheckpointError("no kconvert.json: not a converted checkpoint, or its conversion never finished",
                                  file=str(path)) from None
        except OSError as e:
            raise CheckpointError(f"cannot read kconvert.json: {e.strerror}", file=str(path)) from None
        try:
            doc = json.loads(raw, parse_constant=_no_nan)
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as e:
            raise CheckpointError(f"kconvert.json is not valid JSON: {e}", file=str(path)) from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise CheckpointError("kconvert.json is not a kconvert manifest", file=str(path))
        if doc.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(f"format version {doc.get('format_version')!r} is not the {FORMAT_VERSION} this "
                                  "kconvert reads: convert again or use a matching kconvert", file=str(path))
        if doc.get("digest") != digest_of(doc):
            raise CheckpointError("kconvert.json was changed after it was written (field digest does not match its "
                                  "contents): convert again", file=str(path))
        cat = cls(doc)
        cat.validate(Path(out))
        return cat

    # ------------------------------------------------------------------ writing
    def write(self, out: str | Path) -> None:
        """Validate, stamp the digest and replace OUT/kconvert.json atomically (its presence means complete)."""
        self.validate(Path(out))
        self.doc["digest"] = digest_of(self.doc)
        write_atomic(Path(out) / MANIFEST, json.dumps(self.doc, indent=1).encode())

    # ------------------------------------------------------------------ views
    @property
    def config(self) -> dict:
        return self.doc["config"]

    @property
    def tp(self) -> int:
        return self.doc["layout"]["tp"]

    @property
    def units(self) -> list[str]:
        return self.doc["layout"]["units"]

    @property
    def family(self) -> str:
        return self.doc["source"]["family"]

    @property
    def fingerprint(self) -> str:
        return self.doc["source"]["fingerprint"]

    @property
    def scheme(self) -> str:
        return self.doc["quantization"]["scheme"]

    @property
    def files(self) -> dict[str, dict]:
        return self.doc["files"]

    @property
    def tensors(self) -> list[dict]:
        return self.doc["tensors"]

    def rank_files(self, rank: int) -> dict[str, dict]:
        return {rel: rec for rel, rec in self.files.items() if rec["rank"] == rank}

    def tensors_in(self, rel: str) -> list[dict]:
        return [t for t in self.tensors if t["file"] == rel]

    def path_of(self, out: str | Path, rel: str) -> Path:
        return contained(out, rel, named_in=Path(out) / MANIFEST)

    @staticmethod
    def stored_bytes(rec: dict) -> int:
        """Bytes on disk of a files[*] record: `bytes` is the plain file's size, `stored.bytes` a compressed one's."""
        return rec["stored"]["bytes"] if rec.get("stored") else rec["bytes"]

    # ------------------------------------------------------------------ schema
    def validate(self, out: Path) -> None:
        where = out / MANIFEST

        def bad(field: str, why: str):
            raise CheckpointError(f"field {field}: {why}", file=str(where))

        d = self.doc
        for key, kind in (("config", dict), ("layout", dict), ("source", dict), ("quantization", dict),
                          ("files", dict), ("tensors", list)):
            if not isinstance(d.get(key), kind):
                bad(key, f"missing or not a JSON {'object' if kind is dict else 'list'}")
        lay = d["layout"]
        tp = lay.get("tp")
        if not _int(tp) or tp < 1:
            bad("layout.tp", f"{tp!r} is not a whole number >= 1")
        if not _int(lay.get("ep")) or lay["ep"] < 1:
            bad("layout.ep", f"{lay.get('ep')!r} is not a whole number >= 1")
        units = lay.get("units")
        if not isinstance(units, list) or not units or not all(is_unit(u) for u in units) or len(set(units)) != len(units):
            bad("layout.units", "not a list of distinct unit names (globals, vision, layer-NNNN)")
        for key in ("family", "fingerprint"):
            if not isinstance(d["source"].get(key), str):
                bad(f"source.{key}", "missing or not a string")
        if d["quantization"].get("scheme") not in SCHEMES:
            bad("quantization.scheme", f"{d['quantization'].get('scheme')!r} is not one of {', '.join(SCHEMES)}")
        want = {unit_file(r, u): (r, u) for r in range(tp) for u in units}
        for rel, rec in d["files"].items():
            f = f"files[{rel!r}]"
            contained(out, rel, named_in=where)
            if not isinstance(rec, dict):
                bad(f, "not a JSON object")
            if want.get(rel) != (rec.get("rank"), rec.get("unit")):
                bad(f, f"rank {rec.get('rank')!r} / unit {rec.get('unit')!r} do not match the layout (tp {tp})")
            if rec.get("layer") != unit_layer(rec["unit"]):
                bad(f"{f}.layer", f"{rec.get('layer')!r} does not match unit {rec['unit']}")
            if not _int(rec.get("bytes")) or rec["bytes"] < 0:
                bad(f"{f}.bytes", "not a size in bytes")
            if not isinstance(rec.get("crc32"), str) or not _CRC.fullmatch(rec["crc32"]):
                bad(f"{f}.crc32", "not an 8-digit hex CRC-32")
            stored = rec.get("stored")
            if stored is not None and (not isinstance(stored, dict) or not _int(stored.get("bytes"))
                                       or stored["bytes"] < 0):
                bad(f"{f}.stored", "not a {codec, level, bytes} record")
        missing = sorted(set(want) - set(d["files"]))
        if missing:
            bad("files", f"{len(missing)} file(s) of the layout are not listed (first: {missing[0]})")
        for i, t in enumerate(d["tensors"]):
            f = f"tensors[{i}]"
            if not isinstance(t, dict) or not isinstance(t.get("name"), str):
                bad(f, "not a tensor record with a name")
            rec = d["files"].get(t.get("file"))
            if rec is None:
                bad(f"{f}.file", f"{t.get('file')!r} is not a listed file")
            if t.get("rank") != rec["rank"] or t.get("unit") != rec["unit"]:
                bad(f, f"rank/unit of tensor {t['name']} differ from its file's")
            if t.get("dtype") not in DTYPES:
                bad(f"{f}.dtype", f"{t.get('dtype')!r} is not a safetensors dtype")
            shape = t.get("shape")
            if not isinstance(shape, list) or not all(_int(s) and s >= 0 for s in shape):
                bad(f"{f}.shape", f"{shape!r} is not a list of sizes")
            sl = t.get("slice")
            if sl is not None and (not isinstance(sl, list) or len(sl) != 3 or not all(_int(s) for s in sl)):
                bad(f"{f}.slice", f"{sl!r} is not [dim, start, stop]")
            if not isinstance(t.get("crc32"), str) or not _CRC.fullmatch(t["crc32"]):
                bad(f"{f}.crc32", "not an 8-digit hex CRC-32")


def _int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _no_nan(name: str):
    raise ValueError(f"{name} is not allowed")
