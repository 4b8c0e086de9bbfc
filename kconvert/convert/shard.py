"""`kconvert shard`: execute a conversion plan, streaming, resumable, optionally over many processes.

Units (a layer, globals, vision) are written by `shard_unit.write_unit`, several at once on worker
threads (a bounded window of units ahead); memory depends on the largest tensor, not on the model.
Workers never wait for the disk: this thread takes finished units in order, makes each unit's files
durable together (fsync each, rename, one directory fsync: safetensors_write.commit_all) and only
then records them in the journal (OUT/.kconvert/), one fsync per unit; a re-run with the same job
resumes after the last recorded file, and kconvert.json is written last. Under torchrun, process p takes units p, p + P, p + 2P, ...; process 0
writes kconvert.json.
"""

from __future__ import annotations

import contextlib
import gc
import os
import resource
import shutil
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kconvert import __version__, distributed
from kconvert.errors import KConvertError
from kconvert.source.checkpoint import Checkpoint
from kconvert.converted.catalog import FORMAT, FORMAT_VERSION, Catalog
from kconvert.converted.journal import JOURNAL_DIR, JournalLog, read_done
from kconvert.converted.units import GLOBALS, load_order, unit_layer
from kconvert.convert.layout import Layout
from kconvert.convert.output_dir import check_paths, copy_side_files, prepare_out
from kconvert.convert.quant_policy import FP8_BLOCK, QuantPolicy
from kconvert.convert.shard_plan import Pipeline, WorkItem, plan_items, plan_pipeline
from kconvert.convert.shard_unit import run_unit, write_unit
from kconvert.io.safetensors_write import commit_all


@dataclass(frozen=True)
class ShardJob:
    src: str
    out: str
    tp: int
    ep: int | None = None
    quant: str = "none"
    scale_format: str = "fp32"
    keep: tuple[str, ...] = ()
    force: tuple[str, ...] = ()
    requantize: bool = False
    keep_mtp: bool = False
    workers: int | None = None  # None: default_workers() from the cores and the memory budget
    overwrite: bool = False
    compress: str | None = None  # "zstd[:LEVEL]": compressed shards (a storage form, not part of identity())
    group_size: int = 32  # int4: values per scale
    int4_scales: str = "mse"  # int4: clipping search ("mse") or plain amax scales
    pp: int = 1  # pipeline stages
    pp_layers: str | None = None  # "0-14,15-30,...": the stages' layers (None: balanced by bytes)

    def identity(self, fingerprint: str, layout: Layout, pipe: Pipeline | None = None) -> dict:
        """What must match for two runs to write into the same directory (the pipeline split included)."""
        return {"source_fingerprint": fingerprint, "tp": layout.tp, "ep": layout.ep, "quant": self.quant,
                "pp": self.pp, "pp_layers": pipe.split.spec if pipe else None,
                "scale_format": self.scale_format, "keep": list(self.keep), "force": list(self.force),
                "requantize": self.requantize, "keep_mtp": self.keep_mtp, "format_version": FORMAT_VERSION,
                **({"group_size": self.group_size, "int4_scales": self.int4_scales} if self.quant == "int4" else {})}


@dataclass
class ShardResult:
    out: str
    bytes_in: int = 0
    bytes_out: int = 0
    seconds: float = 0.0
    peak_rss_bytes: int = 0
    files_written: int = 0
    files_resumed: int = 0
    per_rank_bytes: dict[int, int] = field(default_factory=dict)
    already_complete: bool = False

    def to_json(self) -> dict:
        return asdict(self)


# Worker threads: I/O (reads, fsync) overlaps with quantization, so one more than the cores pays; each
# worker holds its tensors plus float32 temporaries, and all of them together stay within MEMORY_SHARE
# of the available memory (and MAX_WORKERS: beyond it the disk, not the CPU, is the limit).
MEMORY_SHARE = 0.25
MAX_WORKERS = 8
WORKER_BYTES_PER_SOURCE_BYTE = {False: 3, True: 4}  # plain copy vs quantize (chunked: + output, scales)


def default_workers(largest_tensor_bytes: int, quantized: bool) -> int:
    """Workers for a conversion whose largest source tensor is `largest_tensor_bytes`."""
    cores = _cores()
    per_worker = max(1, largest_tensor_bytes) * WORKER_BYTES_PER_SOURCE_BYTE[quantized]
    by_memory = int(available_memory() * MEMORY_SHARE) // per_worker
    return max(1, min(cores + 1, MAX_WORKERS, by_memory))


def available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def shard(job: ShardJob, progress=None) -> ShardResult:
    """Run `job`. `progress(event, **kw)` gets ("start", total=bytes), ("advance", n=bytes), ("file", path=...)."""
    t0 = time.perf_counter()
    out = Path(job.out).resolve()
    ck = Checkpoint.open(job.src)
    check_paths(ck, out)
    layout = Layout.make(job.tp, job.ep)
    policy = QuantPolicy(job.quant, job.keep, job.force, job.scale_format, job.group_size, job.int4_scales)
    pipe = plan_pipeline(plan_items(ck, layout, policy, requantize=job.requantize, keep_mtp=job.keep_mtp),
                         layout.tp, job.pp, ck.model.text.layer_count, pp_layers=job.pp_layers,
                         tied=bool(ck.model.text_config.get("tie_word_embeddings")))
    items = pipe.items
    identity = job.identity(ck.fingerprint(), layout, pipe)
    result = ShardResult(str(out))
    level = None
    if job.compress:
        from kconvert.io.compressed import parse_codec

        level = parse_codec(job.compress)[1]

    dist = distributed.Group.from_env()
    if dist.rank == 0:
        state = prepare_out(out, identity, job.overwrite)
    dist.barrier()
    if dist.rank != 0:
        state = prepare_out(out, identity, overwrite=False, follower=True)
    if state == "complete":
        result.already_complete = True
        result.seconds = time.perf_counter() - t0
        return result

    done = _journalled(out)
    by_unit: dict[str, list[WorkItem]] = {}
    for w in items:  # items come in unit order; process p takes units p, p + P, ...
        by_unit.setdefault(w.unit, []).append(w)
    mine = [b for i, b in enumerate(by_unit.values()) if i % dist.world == dist.rank]
    batches = [todo for b in mine if (todo := [w for w in b if w.file not in done])]
    result.files_resumed = sum(len(b) for b in mine) - sum(len(b) for b in batches)
    todo = [w for b in batches for w in b]
    if progress:
        progress("start", total=sum(w.bytes_in for w in todo))
    workers = job.workers or _default_workers(ck, todo, policy)
    with JournalLog(out / JOURNAL_DIR / f"done-{dist.rank:04d}.jsonl") as log, worker_runtime(workers):
        for batch, recs in _units(ck, batches, out, progress, level, workers):
            entries = []
            for w, (rec, stored) in zip(batch, recs):
                entries.append({"file": w.file, "bytes": rec.bytes, "crc32": rec.crc32, "tensors": rec.tensor_crc32})
                if stored:
                    entries[-1]["stored"] = stored
            log.add_all(entries)  # the unit's files are durable (commit_all) before this records them
            for w in batch:
                result.files_written += 1
                result.bytes_in += w.bytes_in
                if progress:
                    progress("file", path=w.file)
    dist.barrier()
    cat = _finish(ck, out, pipe, identity, layout, policy, job) if dist.rank == 0 else None
    dist.barrier()
    cat = cat or Catalog.read(out)  # the other ranks read what rank 0 wrote
    for rec in cat.files.values():
        result.per_rank_bytes[rec["rank"]] = result.per_rank_bytes.get(rec["rank"], 0) + Catalog.stored_bytes(rec)
    result.bytes_out = sum(result.per_rank_bytes.values())
    result.seconds = time.perf_counter() - t0
    result.peak_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return result


def _units(ck: Checkpoint, batches: list[list[WorkItem]], out: Path, progress, level: int | None, workers: int):
    """Yield (batch, [(WrittenFile, stored)]) in unit order, each unit's files durable under their final
    names. Workers run up to `window` units ahead; a unit they finished waits here only for its commit.
    On any error, or when the caller stops early, the units in flight are discarded (temporaries removed)."""
    per_unit = max((len(b) for b in batches), default=1)
    window = max(workers + 1, min(2 * workers, MAX_OPEN_FILES // per_unit))  # finished units hold open files
    with ThreadPoolExecutor(workers) as pool:
        ahead: deque = deque()
        queued = iter(batches)
        try:
            for batch in batches:
                while len(ahead) < window and (nxt := next(queued, None)) is not None:
                    if level is None:
                        ahead.append(pool.submit(write_unit, ck, nxt, out, progress))
                    else:  # compressed shards: each worker commits and compresses its own files
                        ahead.append(pool.submit(run_unit, ck, nxt, out, progress, level))
                done = ahead.popleft().result()
                yield batch, ([(rec, None) for rec in commit_all(done)] if level is None else done)
        except BaseException:
            for f in ahead:
                f.cancel()
            for f in ahead:
                if not f.cancelled() and f.exception() is None and level is None:
                    for wr in f.result():
                        wr.abort()
            raise


MAX_OPEN_FILES = 256  # temporaries held open by finished, not yet committed units


@contextlib.contextmanager
def worker_runtime(workers: int):
    """The workers are the parallelism: torch's own threads would oversubscribe the cores (small
    chunked ops spin-wait on busy cores), so each worker runs its ops on one thread unless there
    are fewer workers than cores. The objects alive before the conversion (torch, the plan) are
    frozen out of the cycle collector, which the conversion's many short-lived tensors trigger
    (measured: about 4 % of the CPU time went to rescanning them)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(max(1, _cores() // max(1, workers)))
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
        torch.set_num_threads(before)


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _default_workers(ck: Checkpoint, todo: list[WorkItem], policy: QuantPolicy) -> int:
    largest = max((ck.logical[o.src].stored_bytes for w in todo for o in w.outputs), default=1)
    return default_workers(largest, quantized=policy.scheme != "none")


def _journalled(out: Path) -> dict[str, dict]:
    """Files recorded finished (by any process) whose bytes are still there."""
    return read_done(sorted((out / JOURNAL_DIR).glob("done-*.jsonl")), out, Catalog.stored_bytes)


def _finish(ck: Checkpoint, out: Path, pipe: Pipeline, identity: dict, layout: Layout, policy: QuantPolicy,
            job: ShardJob) -> Catalog:
    items = pipe.items
    done = _journalled(out)
    missing = [w.file for w in items if w.file not in done]
    if missing:
        raise KConvertError(f"{len(missing)} files were not produced (first: {missing[0]}); re-run to resume",
                            file=str(out))
    copy_side_files(ck, out)
    files, tensors = {}, []
    for w in items:
        rec = done[w.file]
        layer = unit_layer(w.unit)
        files[w.file] = {"rank": w.rank, "stage": w.rank // layout.tp, "unit": w.unit, "layer": layer,
                         "bytes": rec["bytes"], "crc32": rec["crc32"]}
        if rec.get("stored"):
            files[w.file]["stored"] = rec["stored"]
        for o in w.outputs:
            for name, dtype, shape in o.specs():
                tensors.append({"name": name, "file": w.file, "rank": w.rank, "layer": layer, "unit": w.unit,
                                "group": o.info.group, "component": o.info.component, "expert": o.info.expert,
                                "rule": o.info.split, "slice": None if o.piece.dim is None else
                                [o.piece.dim, o.piece.start, o.piece.stop],
                                "transform": o.transform, "dtype": dtype, "shape": list(shape),
                                "crc32": rec["tensors"][name]})
    units = load_order({w.unit for w in items} | {GLOBALS})
    doc = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "created_by": f"kconvert {__version__}",
        "job": identity,
        "source": {"path": str(ck.source), "fingerprint": identity["source_fingerprint"], "family": ck.family},
        "config": ck.config,
        "layout": {"tp": layout.tp, "ep": layout.ep, "pp": job.pp, "world_size": layout.tp * job.pp,
                   "experts": "whole" if layout.expert_tp == 1 else "split", "units": units,
                   "stages": [{"units": u} for u in pipe.stage_units]},
        "quantization": {"scheme": policy.scheme, "block_size": [FP8_BLOCK, FP8_BLOCK] if policy.scheme == "fp8" else None,
                         "scale_format": policy.scale_format, "keep": list(policy.keep), "quantize": list(policy.force),
                         "requantize": job.requantize, "mtp_layers": "kept" if job.keep_mtp else "dropped",
                         **({"group_size": policy.group_size, "int4_scales": policy.int4_scales}
                            if policy.scheme == "int4" else {})},
        "files": files,
        "tensors": tensors,
    }
    cat = Catalog(doc)
    cat.write(out)
    shutil.rmtree(out / JOURNAL_DIR, ignore_errors=True)
    return cat
