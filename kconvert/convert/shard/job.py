"""`kconvert shard`: execute a conversion plan, streaming, resumable, optionally over many processes.

Units (a layer, globals, vision) are written by `shard_unit.write_unit`, several at once on worker
threads (a bounded window of units ahead); memory depends on the largest tensor, not on the model.
Workers never wait for the disk: this thread takes finished units in order, makes each unit's files
durable together (fsync each, rename, one directory fsync: safetensors_write.commit_all) and only
then records them in the journal (OUT/.kconvert/), one fsync per unit; a re-run with the same job
resumes after the last recorded file, and kconvert.json is written last (the run's skeleton: run.py).
Under torchrun, process p takes units p, p + P, p + 2P, ...; process 0 writes kconvert.json.
Calibrated int4 or nvfp4 (`calibrate`, made by the caller: engine/calibrate/layerwise.py runs the layers, a later
stage than this one) takes the units one at a time, in order: each layer's codes come from the layers before it.
Under torchrun every process walks every layer left to do, together, each computing its share of the
layer's experts (engine/calibrate/split.py), and writes its own units (p, p + P, ...) as above.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import KW_ONLY, dataclass, replace
from pathlib import Path

from kconvert import distributed
from kconvert.errors import UsageError
from kconvert.source.checkpoint import Checkpoint
from kconvert.source.side_checks import check_side_files
from kconvert.disk_format.catalog import FORMAT_VERSION, Catalog
from kconvert.disk_format.journal import JOURNAL_DIR
from kconvert.disk_format.units import unit_layer
from kconvert.convert.layout import Layout, Topology
from kconvert.convert.output_dir import check_paths, remove_stale_temporaries
from kconvert.family.release_config import release_config
from kconvert.quant.policy import QuantPolicy
from kconvert.quant.registry import CALIBRATED
from kconvert.source.stored_quant import source_fp8_block
from kconvert.convert.shard.pipeline import Pipeline, plan_pipeline
from kconvert.convert.shard.outputs import WorkItem
from kconvert.convert.shard.catalog import write_catalog
from kconvert.convert.shard.plan import plan_items
from kconvert.convert.export.expert_dtype import source_disagreement
from kconvert.convert.run import Run, RunResult, ShardFigures, default_workers
from kconvert.convert.shard.byte_copy import plain_copies, write_unit_bytes
from kconvert.convert.shard.unit import run_unit, write_unit
from kconvert.io.gc_pause import frozen_gc, keep_to_exit, paused_gc
from kconvert.io.safetensors_write import commit_all
from kconvert.io.window import ordered_window


@dataclass(frozen=True)
class ShardJob:
    """One `kconvert shard`: SRC into OUT, placed by `topology`, quantized by `quant` (its FP8 block is the source's
    own where the source is block FP8: set when the run opens it). Everything after OUT by keyword."""

    src: str
    out: str
    _: KW_ONLY
    topology: Topology = Topology()
    quant: QuantPolicy = QuantPolicy()
    keep_mtp: bool = True  # the draft heads (MTP layers) the source has; False: left out (shard --no-draft-heads)
    workers: int | None = None  # None: default_workers() from the cores and the memory budget
    overwrite: bool = False
    compress: str | None = None  # "zstd[:LEVEL]": compressed shards (a storage form, not part of identity())

    def identity(self, fingerprint: str, layout: Layout, pipe: Pipeline | None = None) -> dict:
        """What must match for two runs to write into the same directory (the pipeline split included)."""
        q = self.quant
        return {"source_fingerprint": fingerprint, "tp": layout.tp, "ep": layout.ep, "quant": q.scheme,
                "pp": self.topology.pp, "pp_layers": pipe.split.spec if pipe else None,
                "scale_format": q.scale_format, "keep": list(q.keep), "force": list(q.force),
                "requantize": q.requantize, "keep_mtp": self.keep_mtp, "format_version": FORMAT_VERSION,
                **({"group_size": q.group_size, "int4_scales": q.int4_scales} if q.scheme == "int4" else {})}


def shard(job: ShardJob, progress=None, calibrate=None) -> RunResult:
    with ExitStack() as after_plan:  # the source's and the plan's objects, frozen out of the collector's walks
        return _shard(job, progress, calibrate, after_plan)


def _shard(job: ShardJob, progress, calibrate, after_plan: ExitStack) -> RunResult:
    """Run `job`. `progress(event, **kw)` gets ("start", total=bytes), ("working", n=bytes) as tensors are made,
    ("advance", n=bytes) and ("file", path=...) as each file becomes durable.
    `calibrate(ck, policy, progress)`: makes the calibration (engine/calibrate.LayerCalibration) of an int4 or nvfp4
    job."""
    run = Run(job.out, progress, details=ShardFigures())
    out = run.out
    with paused_gc():  # the source's headers frozen before the collector resumes (else its next pass walks them all)
        ck = Checkpoint.open(job.src)
        freeze = after_plan.enter_context(frozen_gc())
    supported = ck.model.family.get("shard_quant")  # modes not done for this family are refused, never guessed
    if supported is not None and job.quant.scheme not in supported:
        ck.validate()  # a damaged source is named as such first
        raise UsageError(f"--quant {job.quant.scheme} is not supported for {ck.family} yet (supported: "
                         f"{', '.join(supported)})", file=str(ck.root / "config.json"))
    check_paths(ck, out)
    check_side_files(ck)  # what the engine reads at run time (tokenizer, chat template, Engram map), before any work
    release_config(ck.config, ck.model.family)  # config.json's release spelling: a config with none refused here
    layout, topo = job.topology.layout, job.topology
    policy = replace(job.quant, fp8_block=source_fp8_block(ck.quantization_config), family=ck.model.family)
    with paused_gc():  # the plan's 100k+ outputs: no cycles, and frozen before the collector resumes
        pipe = plan_pipeline(plan_items(ck, layout, policy, requantize=policy.requantize, keep_mtp=job.keep_mtp),
                             layout.tp, topo.pp, ck.model.text.layer_count, pp_layers=topo.pp_layers,
                             tied=bool(ck.model.text_config.get("tie_word_embeddings")),
                             draft_embed="embed" in ck.model.family.get("draft_shares", ()))
        items = pipe.items
        freeze()  # every output's specs included (plan_items makes them): 100k+ tuples the collector skips
    identity = job.identity(ck.fingerprint(), layout, pipe)
    result = run.result
    result.warnings += filter(None, [source_disagreement(ck)])
    calibration = None
    dist = distributed.Group.from_env()
    if calibrate is not None:
        if policy.scheme not in CALIBRATED:
            raise UsageError(f"--calibrate computes int4 and nvfp4 codes (GPTQ); --quant {policy.scheme} has no "
                             "calibrated path")
        calibration = calibrate(ck, policy, progress)
        if dist.world > 1:
            calibration.share(dist)
        identity["calibration"] = calibration.record
    level = None
    if job.compress:
        from kconvert.io.compressed import parse_codec

        level = parse_codec(job.compress)[1]

    if run.prepare(identity, job.overwrite, group=dist):
        return result
    if calibration is not None:
        calibration.attach(out / JOURNAL_DIR / "calibration", identity)

    done = run.journalled(Catalog.stored_bytes)
    by_unit: dict[str, list[WorkItem]] = {}
    for w in items:  # items come in unit order; process p takes units p, p + P, ...
        by_unit.setdefault(w.unit, []).append(w)
    mine = [b for i, b in enumerate(by_unit.values()) if i % dist.world == dist.rank]
    batches = [todo for b in mine if (todo := [w for w in b if w.file not in done])]
    result.files_resumed = sum(len(b) for b in mine) - sum(len(b) for b in batches)
    todo = [w for b in batches for w in b]
    remove_stale_temporaries(out, [w.file for w in todo])
    freeze()  # the identity and the batches too (the workers' runtime keeps this freeze)
    run.start(sum(w.bytes_in for w in todo))
    small = _small_tensors(todo)
    workers = job.workers or _default_workers(ck, todo, policy, small)
    # small tensors: torch on one thread (stacked ops of a few MB gain little from a second one, whose
    # spin-wait between ops cost 3.7x the CPU time on topo-k25: measured with 2 threads on 2 cores)
    threads = 1 if small else None
    as_bytes = calibration is None and level is None and plain_copies(ck, todo)  # no torch (byte_copy.py)
    if calibration is None:
        units = _units(ck, batches, out, progress, level, workers, as_bytes)
    else:  # the layers any process has left to write: every process calibrates each of them
        layers = sorted({L for part in dist.all_gather_object([unit_layer(b[0].unit) for b in batches])
                         for L in part if L is not None})
        units = _calibrated_units(ck, batches, layers, out, progress, level, calibration)
    with run.log(f"done-{dist.rank:04d}.jsonl", None if as_bytes else workers, threads) as log:
        for batch, recs in units:
            entries = []
            for w, (rec, stored) in zip(batch, recs):
                entries.append({"file": w.file, "bytes": rec.bytes, "crc32": rec.crc32, "tensors": rec.tensor_crc32})
                if stored:
                    entries[-1]["stored"] = stored
                if rec.notes:  # its exact casts' blocks (quant/tally.py): summed into kconvert.json at the end
                    entries[-1]["casts"] = rec.notes
            log.add_all(entries)  # the unit's files are durable (commit_all) before this records them
            for w in batch:
                run.wrote(w.file, w.bytes_in)
    # under torchrun each process wrote its share: the summary totals every process's
    shares = dist.all_gather_object((result.files_written, result.files_resumed, result.bytes_in))
    result.files_written, result.files_resumed, result.bytes_in = (sum(s[i] for s in shares) for i in range(3))
    result.details.processes = dist.world
    cat = None
    if dist.rank == 0:
        with paused_gc():  # the journal's records and every tensor's row: 100k+ each, no cycles
            cat = run.finish([w.file for w in items], Catalog.stored_bytes,
                             lambda done: write_catalog(ck, out, pipe, identity, layout, policy, job, done,
                                                         calibration.record if calibration else None))
    dist.barrier()
    cat = cat or Catalog.read(out)  # the other ranks read what rank 0 wrote
    for rec in cat.files.values():
        per_rank = result.details.per_rank_bytes
        per_rank[rec["rank"]] = per_rank.get(rec["rank"], 0) + Catalog.stored_bytes(rec)
    result.bytes_out = sum(result.details.per_rank_bytes.values())
    if calibration is not None:
        result.details.calibration = {**calibration.record, "layers": calibration.figures}
    result.details.exact_casts = cat.doc["quantization"].get("exact_casts")
    keep_to_exit(ck, pipe, cat)
    return run.done()


def _units(ck: Checkpoint, batches: list[list[WorkItem]], out: Path, progress, level: int | None, workers: int,
           as_bytes: bool = False):
    """Yield (batch, [(WrittenFile, stored)]) in unit order, each unit's files durable under their final
    names. Workers run up to `window` units ahead; a unit they finished waits here only for its commit.
    On any error, or when the caller stops early, the units in flight are discarded (temporaries removed).
    `as_bytes`: every output is a plain copy, written by byte_copy.write_unit_bytes (no torch)."""
    per_unit = max((len(b) for b in batches), default=1)
    window = max(workers + 1, min(2 * workers, MAX_OPEN_FILES // per_unit))  # finished units hold open files
    if as_bytes:
        work, discard = (lambda b: write_unit_bytes(ck, b, out, progress)), _abort_all
    elif level is None:
        work, discard = (lambda b: write_unit(ck, b, out, progress)), _abort_all
    else:  # compressed shards: each worker commits and compresses its own files
        work, discard = (lambda b: run_unit(ck, b, out, progress, level)), None
    with ThreadPoolExecutor(workers) as pool, ordered_window(pool, work, batches, window, discard) as units:
        for batch, done in units:
            yield batch, ([(rec, None) for rec in commit_all(done)] if level is None else done)


def _calibrated_units(ck: Checkpoint, batches: list[list[WorkItem]], layers: list[int], out: Path, progress,
                      level: int | None, calibration):
    """Like _units, one unit at a time: units without a layer first, then each of `layers` in order (with the
    other processes): its calibrated codes, then its files where the unit is this process's; once every
    process has journalled its files, the calibration drops the layer inputs a resume no longer needs."""
    mine = {}
    for batch in batches:
        L = unit_layer(batch[0].unit)
        if L is None:
            yield batch, run_unit(ck, batch, out, progress, level, {})
        else:
            mine[L] = batch
    for L in layers:
        codes = calibration.layer(L)
        if L in mine:
            yield mine[L], run_unit(ck, mine[L], out, progress, level, codes)
        calibration.done_before(L + 1)


def _abort_all(writers) -> None:
    for w in writers:
        w.abort()


MAX_OPEN_FILES = 256  # temporaries held open by finished, not yet committed units


SMALL_TENSOR_BYTES = 1 << 20  # below this on average, per-tensor Python work, not data, sets the pace


def _small_tensors(todo: list[WorkItem]) -> bool:
    outputs = [o for w in todo for o in w.outputs]
    return sum(o.bytes_in for o in outputs) < SMALL_TENSOR_BYTES * len(outputs)


def _default_workers(ck: Checkpoint, todo: list[WorkItem], policy: QuantPolicy, small: bool) -> int:
    """From the memory budget; one worker when the tensors are small on average: their work holds the GIL
    (torch releases it only for large ops), so more threads only contend for it (measured on topo-k25
    at 11 layers: 3 workers took 1.5x the CPU time of 1, and no less wall time)."""
    if small:
        return 1
    outputs = [o for w in todo for o in w.outputs]
    largest = max((ck.logical[o.src].stored_bytes for o in outputs), default=1)
    return default_workers(largest, quantized=policy.scheme != "none")
