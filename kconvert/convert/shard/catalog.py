"""kconvert.json and the per-rank tensor lists of a finished `kconvert shard` run (converted/catalog.py's format),
from the plan's work items and the journal's records of every file: written last, so their presence means a
complete conversion. A release's 250k+ tensor rows are made a column at a time per file (its outputs share a few
plan decisions), not a Python step each."""

from __future__ import annotations

from collections.abc import Iterator
from itertools import chain, repeat
from operator import attrgetter
from pathlib import Path

from kconvert import __version__
from kconvert.disk_format.catalog import FORMAT, FORMAT_VERSION, Catalog
from kconvert.disk_format.units import GLOBALS, load_order, unit_layer
from kconvert.convert.layout import Layout
from kconvert.convert.output_dir import copy_side_files
from kconvert.quant.policy import QuantPolicy
from kconvert.convert.shard.outputs import WorkItem
from kconvert.convert.shard.pipeline import Pipeline
from kconvert.source.checkpoint import Checkpoint


def catalog_rows(w: WorkItem, crcs: dict[str, str], shared: dict) -> Iterator[tuple]:
    """File w's tensor rows (rank_tensors.COLUMNS; a weight and its scale: two rows), a column at a time: a release's
    file holds hundreds of experts' tensors, their outputs sharing a few Hows."""
    outs = w.outputs
    hows = list(map(_HOW, outs))
    for how, o in dict(zip(hows, outs)).items():  # (an output of each How: they share its rule)
        if how in shared:
            continue
        p = how.piece
        shared[how] = (o.info.group, o.info.component, o.info.split,
                       None if p.dim is None else (p.dim, p.start, p.stop), how.transform)
    common = list(map(shared.__getitem__, hows))
    experts = list(map(_EXPERT, outs))
    specs = list(map(_SPEC_ROWS, outs))
    per = list(map(len, specs))
    if per.count(1) != len(per):  # each output's columns once per tensor it writes
        common = list(chain.from_iterable(map(repeat, common, per)))
        experts = list(chain.from_iterable(map(repeat, experts, per)))
    names, tags, shapes = zip(*chain.from_iterable(specs)) if specs else ((), (), ())
    group, component, split, sl, transform = zip(*common) if common else ((),) * 5
    return zip(names, repeat(w.unit), group, component, experts, split, sl, transform, tags, shapes,
               map(crcs.__getitem__, names))


_HOW, _EXPERT, _SPEC_ROWS = attrgetter("how"), attrgetter("info.expert"), attrgetter("spec_rows")


def write_catalog(ck: Checkpoint, out: Path, pipe: Pipeline, identity: dict, layout: Layout, policy: QuantPolicy,
                   job, done: dict[str, dict], calibration: dict | None = None) -> Catalog:
    """Side files, then kconvert.json (atomically, last) from the journal records of every file. `job`: the run's
    shard.ShardJob (its pp, requantize and keep_mtp)."""
    items = pipe.items
    copy_side_files(ck, out)
    files, rows = {}, [[] for _ in range(layout.tp * job.topology.pp)]  # each rank's tensor rows (rank_tensors.COLUMNS)
    # what the outputs of one plan decision (one How: a rule, a layer, a cut, a transform) share, worked out once
    shared: dict = {}
    casts: dict[str, dict[str, int]] = {}  # exact casts' blocks per tensor kind, from every file's journal record
    for w in items:
        file, unit = w.file, w.unit
        rec = done[file]
        files[file] = {"rank": w.rank, "stage": w.rank // layout.tp, "unit": unit, "layer": unit_layer(unit),
                       "bytes": rec["bytes"], "crc32": rec["crc32"]}
        if rec.get("stored"):
            files[file]["stored"] = rec["stored"]
        for kind, (exact, derived) in (rec.get("casts") or {}).items():
            have = casts.setdefault(kind, {"exact": 0, "data_derived": 0})
            have["exact"] += exact
            have["data_derived"] += derived
        rows[w.rank].extend(catalog_rows(w, rec["tensors"], shared))
    units = load_order({w.unit for w in items} | {GLOBALS})
    doc = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "created_by": f"kconvert {__version__}",
        "job": identity,
        "source": {"path": str(ck.source), "fingerprint": identity["source_fingerprint"], "family": ck.family},
        "config": ck.config,
        "layout": {"tp": layout.tp, "ep": layout.ep, "pp": job.topology.pp, "world_size": layout.tp * job.topology.pp,
                   "experts": "whole" if layout.expert_tp == 1 else "split", "units": units,
                   "stages": [{"units": u} for u in pipe.stage_units]},
        "quantization": {"scheme": policy.scheme,
                         "block_size": [policy.fp8_block] * 2 if policy.scheme in ("fp8", "nvfp4") else None,
                         "scale_format": policy.scale_format, "keep": list(policy.keep), "quantize": list(policy.force),
                         "requantize": job.quant.requantize, "mtp_layers": "kept" if job.keep_mtp else "dropped",
                         **({"group_size": policy.group_size, "int4_scales": policy.int4_scales}
                            if policy.scheme == "int4" else {}),
                         **({"calibration": calibration} if calibration else {}),
                         **({"exact_casts": dict(sorted(casts.items()))} if casts else {})},
        "files": files,
    }
    cat = Catalog(doc)
    cat.write(out, rows)
    return cat
