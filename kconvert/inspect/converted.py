"""`kconvert inspect OUT` of a converted directory: what its kconvert.json says, read through `Catalog`
(digest and schema checked, every rank list against its shards' headers, no tensor data read): family, tp x pp and ranks, scheme and its options, bytes
on disk per rank, whether its shards are compressed, and the source it was converted from."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from kconvert.disk_format.units import MANIFEST


@dataclass
class ConvertedSummary:
    path: str
    family: str
    tp: int
    pp: int
    ep: int
    ranks: int
    scheme: str
    quantization: dict  # kconvert.json's quantization record (scheme options)
    compressed: str  # "no", "yes" or "partly" (an unfinished `kconvert pack`)
    files: int
    tensors: int
    bytes_on_disk: int
    bytes_per_rank: dict[int, int] = field(default_factory=dict)
    source: dict = field(default_factory=dict)  # path and fingerprint of the source
    kind: str = "converted"

    def to_json(self) -> dict:
        return asdict(self)


def is_converted(path: str | Path) -> bool:
    return (Path(path) / MANIFEST).exists()


def summarize_converted(out: str | Path) -> ConvertedSummary:
    from kconvert.disk_format.catalog import Catalog  # here: `inspect` of a source checkpoint never needs it

    from kconvert.disk_format.integrity import check_headers

    cat = Catalog.read(out)
    check_headers(Path(out), cat)  # rank lists that do not describe their shards: one line, not a wrong summary
    per_rank = {r: sum(Catalog.stored_bytes(rec) for rec in cat.rank_files(r).values()) for r in range(cat.world_size)}
    packed = sum(1 for rec in cat.files.values() if rec.get("stored"))
    compressed = "no" if packed == 0 else "yes" if packed == len(cat.files) else "partly"
    src = cat.doc["source"]
    return ConvertedSummary(
        path=str(out), family=cat.family, tp=cat.tp, pp=cat.pp, ep=cat.doc["layout"].get("ep", cat.tp),
        ranks=cat.world_size, scheme=cat.scheme, quantization=dict(cat.doc["quantization"]), compressed=compressed,
        files=len(cat.files), tensors=len(cat.tensors), bytes_on_disk=sum(per_rank.values()), bytes_per_rank=per_rank,
        source={"path": src.get("path"), "fingerprint": src.get("fingerprint")})
