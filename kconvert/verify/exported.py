"""`kconvert verify` of a Hugging Face-layout directory (a `kconvert export`, or any release kconvert
reads): it is resharded through `shard` into a temporary converted directory (tp `--tp`) and that is
verified, so the engine runs exactly the exported weights.

Block-FP8 and int8 weights stay in their format (fp8 blocks are copied, int8 per-channel re-quantizes
to the same bytes); int4 and per-channel fp8 are dequantized to bf16 (exact for fp8, and int4 × bf16
scale rounds once) and judged by the fp8 bounds. A reference made from the export's own source is
accepted without --force (the index records that source's fingerprint)."""

from __future__ import annotations

import contextlib
from kconvert.io.workdir import base_dir, scrub, work_dir
from pathlib import Path

from kconvert.converted.catalog import MANIFEST
from kconvert.convert.shard import ShardJob, shard
from kconvert.errors import KConvertError, UsageError
from kconvert.io.side_files import MAX_INDEX, read_json
from kconvert.source.checkpoint import INDEX, Checkpoint
from kconvert.verify.verdict import thresholds

# exported quantization -> (shard --quant that keeps it, thresholds it is judged by)
_SCHEME = {"fp8-block": ("fp8", "fp8"), "int-quantized": ("int8", "int8"), "float-quantized": ("none", "fp8"),
           "pack-quantized": ("none", "fp8"), None: ("none", "none")}


def is_converted(path: str) -> bool:
    return (Path(path) / MANIFEST).exists()


@contextlib.contextmanager
def as_converted(path: str, tp: int = 1):
    """Yield (converted dir, thresholds, fingerprint of the source the export was made from or None)."""
    root = Path(path)
    if not (root / "config.json").exists():
        raise UsageError(f"neither a converted directory ({MANIFEST}) nor a checkpoint (config.json)", file=path)
    ck = Checkpoint.open(path)
    qc = ck.quantization_config
    kind = "fp8-block" if qc.get("quant_method") == "fp8" else qc.get("format")
    if kind not in _SCHEME:
        raise UsageError(f"verify cannot judge quantization format {kind!r}", file=str(root / "config.json"))
    quant, scheme = _SCHEME[kind]
    made_from = None
    if (root / INDEX).exists():
        made_from = (read_json(root / INDEX, limit=MAX_INDEX).get("metadata") or {}).get("kconvert_job", {}).get(
            "source_fingerprint")
    with work_dir("verify-export") as tmp:  # as large as the conversion: removed on every way out
        out = Path(tmp) / "converted"
        try:
            shard(ShardJob(path, str(out), tp=tp, quant=quant))
        except KConvertError as e:
            raise scrub(e, tmp, f"resharding the export for verify (under {base_dir()}, removed)") from None
        yield str(out), dict(thresholds()["cost"][scheme]), made_from


def reference_matches(made_from: str | None, reference: str | None, against: str | None) -> bool:
    """Whether the reference (file or source) was made from the source the export was made from."""
    if made_from is None:
        return False
    if against is not None:
        return Checkpoint.open(against, headers_only=True).fingerprint() == made_from
    from kconvert.verify.reference import load_reference

    return reference is not None and load_reference(reference)[0]["source_fingerprint"] == made_from
