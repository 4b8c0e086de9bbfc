"""`kconvert verify` of a Hugging Face-layout directory (a `kconvert export`, or any release kconvert
reads). What it is (`describe`): its format (fp8-block, w4a16, w8a8-int8, fp8-channel, or none), the cost
budget that format is judged by (its scheme's, manifests/verify_thresholds.toml), and the source it was
made from as the export's index records it (fingerprint and path).

How the engine runs it (`as_converted`): resharded through `shard` into a temporary converted directory
(tp `--tp`). Block-FP8 blocks are copied and int8 per-channel re-quantizes to the same bytes; int4 and
per-channel fp8 are dequantized to bf16. The faithfulness reference is the source fake-quantized with the
export's own rule and the scales the export stores, then put through that conversion's own transform
(verify/fake_quant.py `write_export_fake_quant_source`), so a clean export agrees to fp32 round-off and a
damaged one (weights or scales) FAILs.

The temporary directory lives in `as_converted` only, under kconvert's work directory (io/workdir): removed on
every way out, reclaimed by the next run after a kill, and never named in a message."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from kconvert.disk_format.catalog import MANIFEST
from kconvert.convert.export.table import EXPORT_FORMATS, format_of, runs_as
from kconvert.convert.shard.job import ShardJob, shard
from kconvert.convert.layout import Topology
from kconvert.quant.policy import QuantPolicy
from kconvert.errors import KConvertError, UsageError
from kconvert.io.side_files import MAX_INDEX, read_json
from kconvert.io.workdir import base_dir, scrub, work_dir
from kconvert.quant.registry import NONE
from kconvert.source.checkpoint import INDEX, Checkpoint

@dataclass(frozen=True)
class Export:
    path: str
    format: str  # a name of export/table.FORMATS, or "none" (unquantized)
    budget: str  # the [cost.*] table it is judged by: its scheme's name
    runs_as: str  # the `shard --quant` its temporary conversion uses (export/table.ExportFormat.runs_as)
    made_from: str | None  # the source fingerprint the export's index records (None: not made by kconvert)
    source: str | None  # the source path it records


def describe(path: str) -> Export:
    root = Path(path)
    if not (root / "config.json").exists():
        raise UsageError(f"neither a converted directory ({MANIFEST}) nor a checkpoint (config.json)", file=path)
    qc = Checkpoint.open(path, headers_only=True).quantization_config
    fmt = format_of(qc)
    if fmt is None:
        raise UsageError(f"verify cannot judge quantization {qc.get('quant_method')!r} / {qc.get('format')!r} "
                         f"(exports: {', '.join(EXPORT_FORMATS)})", file=str(root / "config.json"))
    meta = {}
    if (root / INDEX).exists():
        meta = read_json(root / INDEX, limit=MAX_INDEX).get("metadata") or {}
    job = meta.get("kconvert_job") or {}
    budget = EXPORT_FORMATS[fmt].scheme if fmt in EXPORT_FORMATS else NONE
    return Export(str(path), fmt, budget, runs_as(qc), job.get("source_fingerprint"), meta.get("source"))


@contextlib.contextmanager
def as_converted(export: Export, tp: int = 1):
    """Yield a temporary converted directory (tp ranks) of the export; removed when the context ends."""
    with work_dir("verify-export") as tmp:  # as large as the conversion: removed on every way out
        out = Path(tmp) / "converted"
        try:
            shard(ShardJob(export.path, str(out), topology=Topology(tp=tp), quant=QuantPolicy(scheme=export.runs_as)))
        except KConvertError as e:
            raise scrub(e, tmp, f"resharding the export for verify (under {base_dir()}, removed)") from None
        yield str(out)
