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
from dataclasses import dataclass, field
from pathlib import Path

from kconvert.errors import CheckpointError
from kconvert.io.atomic import write_atomic
from kconvert.io.paths import contained, contained_all
from kconvert.disk_format import rank_tensors
from kconvert.io.side_files import MAX_CATALOG, read_json
from kconvert.disk_format.units import GLOBALS, MANIFEST, VISION, is_unit, unit_file, unit_layer
from kconvert.quant.registry import SHARD_SCHEMES

FORMAT = "kconvert"
# 4: each rank's tensor list in rank-RRR/tensors.json (converted/rank_tensors.py), kconvert.json records their
# sha256 in `tensors_by_rank`; 3: pipeline stages (layout.pp, layout.stages, files[*].stage); 2: adds `digest`
FORMAT_VERSION = 4
READABLE_VERSIONS = (2, 3, 4)  # a version-2 directory reads as pp = 1; version 1 is refused with "convert again"
SPLIT_VERSION = 4  # from this version on the tensor lists live per rank
SCHEMES = SHARD_SCHEMES  # what `shard` writes: "none" and every scheme in kconvert/quant/registry.py it offers
_CRC = re.compile(r"[0-9a-f]{8}")


def digest_of(doc: dict) -> str:
    """sha256 over the canonical JSON of everything but the digest itself."""
    body = {k: v for k, v in doc.items() if k != "digest"}
    canon = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return "sha256:" + hashlib.sha256(canon.encode()).hexdigest()


@dataclass
class Catalog:
    """`doc` is kconvert.json (validated; mutate only through methods that re-validate). From version 4 on it
    holds no tensor list: `rank_tensors(r)` reads rank r's (checked against its sha256) and `tensors` every
    rank's. A doc given whole (with `tensors`, as shard builds it) is split into per-rank lists by `write`."""

    doc: dict
    root: Path | None = None  # the directory read from (where the per-rank lists are)
    _lists: dict = field(default_factory=dict, repr=False)  # rank -> its checked tensor records

    # ------------------------------------------------------------------ reading
    @classmethod
    def read(cls, out: str | Path) -> "Catalog":
        path = Path(out) / MANIFEST
        try:
            doc = read_json(path, limit=MAX_CATALOG, parse_constant=_no_nan)
        except FileNotFoundError:
            raise CheckpointError("no kconvert.json: not a converted checkpoint, or its conversion never finished",
                                  file=str(path)) from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise CheckpointError("kconvert.json is not a kconvert manifest", file=str(path))
        if doc.get("format_version") not in READABLE_VERSIONS:
            raise CheckpointError(f"format version {doc.get('format_version')!r} is not the {FORMAT_VERSION} this "
                                  "kconvert reads: convert again or use a matching kconvert", file=str(path))
        if doc.get("digest") != digest_of(doc):
            raise CheckpointError("kconvert.json was changed after it was written (field digest does not match its "
                                  "contents): convert again", file=str(path))
        cat = cls(doc, Path(out))
        cat.validate(Path(out))
        return cat

    # ------------------------------------------------------------------ writing
    def write(self, out: str | Path, rows: list[list] | None = None) -> None:
        """Validate, stamp the digest and replace OUT/kconvert.json atomically (its presence means complete).
        `rows`: every rank's tensor rows (rank_tensors.COLUMNS) as shard makes them, for a doc without `tensors`:
        written as they are, each checked when its rank's list is read (load, verify-files), as any reader's."""
        if rows is not None:  # the per-rank lists first: kconvert.json, written last, records them
            self.doc["tensors_by_rank"] = rank_tensors.write_rows(Path(out), rows)
        self.validate(Path(out))
        if self.split and "tensors" in self.doc:
            records = self.doc.pop("tensors")
            self.doc["tensors_by_rank"] = rank_tensors.write_lists(Path(out), records, self.world_size)
            self._lists = dict(enumerate(rank_tensors.split_by_rank(records, self.world_size)))
        self.doc["digest"] = digest_of(self.doc)
        write_atomic(Path(out) / MANIFEST, json.dumps(self.doc, indent=1).encode())
        self.root = Path(out)

    # ------------------------------------------------------------------ views
    @property
    def config(self) -> dict:
        return self.doc["config"]

    @property
    def tp(self) -> int:
        return self.doc["layout"]["tp"]

    @property
    def units(self) -> list[str]:
        """Every unit of the conversion, over all stages."""
        return self.doc["layout"]["units"]

    # ---- pipeline stages: global rank = stage * tp + tp_rank (version 2 directories: one stage)
    @property
    def pp(self) -> int:
        return self.doc["layout"].get("pp", 1)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    def stage_of(self, rank: int) -> int:
        return rank // self.tp

    def tp_rank_of(self, rank: int) -> int:
        return rank % self.tp

    def rank_of(self, stage: int, tp_rank: int) -> int:
        return stage * self.tp + tp_rank

    def stage_units(self, stage: int) -> list[str]:
        """The units the ranks of one stage hold. With pp > 1, `globals` is on the first stage (embeddings)
        and on the last (final norm and head; the embeddings too when the head is tied to them)."""
        stages = self.doc["layout"].get("stages")
        return list(stages[stage]["units"]) if stages else list(self.units)

    def stage_layers(self, stage: int) -> list[int]:
        """Decoder layers (MTP layers kept by --keep-mtp included) of one stage, in order."""
        return sorted(L for u in self.stage_units(stage) if (L := unit_layer(u)) is not None)

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
    def split(self) -> bool:
        """Whether the tensor lists live per rank (format version 4 on)."""
        return self.doc["format_version"] >= SPLIT_VERSION

    @property
    def tensors(self) -> list[dict]:
        """Every tensor record of every rank (reads every rank's list: a rank needs only `rank_tensors`)."""
        if "tensors" in self.doc:
            return self.doc["tensors"]
        return [t for r in range(self.world_size) for t in self.rank_tensors(r)]

    def whole_doc(self) -> dict:
        """kconvert.json with every rank's tensor list inline (as version 3 held it), for readers of all of it."""
        return {**self.doc, "tensors": self.tensors}

    def rank_tensors(self, rank: int) -> list[dict]:
        """The tensor records of one rank: only its own list is read."""
        if "tensors" in self.doc:
            return [t for t in self.doc["tensors"] if t["rank"] == rank]
        if rank not in self._lists:
            entry = self.doc["tensors_by_rank"][rank]
            self._lists[rank] = rank_tensors.read_list(self.root, rank, entry, self.files)
        return self._lists[rank]

    def rank_rows(self, rank: int) -> list:
        """One rank's tensors as rows (rank_tensors.COLUMNS), checked as `rank_tensors` checks them, without a
        record a tensor: the loader's read of its own list."""
        if "tensors" in self.doc or rank in self._lists:
            return list(map(rank_tensors.ROW, self.rank_tensors(rank)))
        entry = self.doc["tensors_by_rank"][rank]
        return rank_tensors.read_rows(self.root, rank, entry, self.files)

    def rank_files(self, rank: int) -> dict[str, dict]:
        return {rel: rec for rel, rec in self.files.items() if rec["rank"] == rank}

    def tensors_in(self, rel: str) -> list[dict]:
        return [t for t in self.rank_tensors(self.files[rel]["rank"]) if t["file"] == rel]

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
        whole = not d.get("format_version", FORMAT_VERSION) >= SPLIT_VERSION or "tensors" in d  # tensors inline
        for key, kind in (("config", dict), ("layout", dict), ("source", dict), ("quantization", dict),
                          ("files", dict), ("tensors", list) if whole else ("tensors_by_rank", list)):
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
        pp = lay.get("pp", 1)
        if not _int(pp) or pp < 1:
            bad("layout.pp", f"{pp!r} is not a whole number >= 1")
        if lay.get("world_size", tp * pp) != tp * pp:
            bad("layout.world_size", f"{lay.get('world_size')!r} is not tp x pp = {tp * pp}")
        self._validate_stages(lay, bad)
        want = {unit_file(r, u): (r, u) for r in range(tp * pp) for u in self.stage_units(r // tp)}
        contained_all(out, d["files"], named_in=where)
        for rel, rec in d["files"].items():
            f = f"files[{rel!r}]"
            if not isinstance(rec, dict):
                bad(f, "not a JSON object")
            if want.get(rel) != (rec.get("rank"), rec.get("unit")):
                bad(f, f"rank {rec.get('rank')!r} / unit {rec.get('unit')!r} do not match the layout (tp {tp}, pp {pp})")
            if rec.get("stage", 0 if pp == 1 else None) != rec["rank"] // tp:
                bad(f"{f}.stage", f"{rec.get('stage')!r} is not the stage of rank {rec['rank']} (rank // tp)")
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
        if not whole:
            rank_tensors.check_index(d["tensors_by_rank"], tp * pp, bad)
            return
        files, seen = d["files"], set()  # 100k+ records: those like one checked already pass at once
        for i, t in enumerate(d["tensors"]):
            rec = files.get(t.get("file")) if isinstance(t, dict) else None
            if rec is not None and t.get("rank") == rec["rank"] and t.get("unit") == rec["unit"] \
                    and rank_tensors.known(t, seen):
                continue
            f = f"tensors[{i}]"
            if not isinstance(t, dict):
                bad(f, "not a tensor record with a name")
            if rec is None:
                bad(f"{f}.file", f"{t.get('file')!r} is not a listed file")
            rank_tensors.check_record(f, t, bad, rec, seen)

    @staticmethod
    def _validate_stages(lay: dict, bad) -> None:
        """layout.stages (absent = one stage): pp records of {"units": [...]}, each layer unit in exactly one
        stage, stages holding contiguous layers in order, globals on the first and last stage, vision on the first."""
        stages, pp, units = lay.get("stages"), lay.get("pp", 1), lay["units"]
        if stages is None:
            if pp != 1:
                bad("layout.stages", f"missing: pp is {pp}")
            return
        if not isinstance(stages, list) or len(stages) != pp or not all(
                isinstance(s, dict) and isinstance(s.get("units"), list) and all(u in units for u in s["units"])
                for s in stages):
            bad("layout.stages", f"not {pp} records of {{units: [...]}} naming units of layout.units")
        layers = [[unit_layer(u) for u in s["units"] if unit_layer(u) is not None] for s in stages]
        flat = [L for ls in layers for L in ls]
        if flat != sorted(flat) or len(set(flat)) != len(flat) or \
                sorted(flat) != sorted(L for u in units if (L := unit_layer(u)) is not None):
            bad("layout.stages", "layers are not split into contiguous stages, each layer in exactly one")
        if any(not ls for ls in layers):
            bad("layout.stages", "a stage holds no decoder layer")
        for i, s in enumerate(stages):
            edge = {GLOBALS} if i in (0, pp - 1) else set()
            extra = {u for u in s["units"] if unit_layer(u) is None} - edge - ({VISION} if i == 0 else set())
            if extra or (GLOBALS in units and not edge <= set(s["units"])) or len(set(s["units"])) != len(s["units"]):
                bad(f"layout.stages[{i}]", "globals must be on the first and last stage only, vision on the first")


def _int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _no_nan(name: str):
    raise ValueError(f"{name} is not allowed")
