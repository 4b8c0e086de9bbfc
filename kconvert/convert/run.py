"""The skeleton of a journalled, resumable run into a directory, shared by `shard`, `export` and `pack`.

    run = Run(out, progress)
    if run.prepare(identity, overwrite):          # OUT already holds this job, complete: nothing to do
        return run.result
    done = run.journalled(size_of)                # files an interrupted run finished (and still there)
    run.start(total_bytes)                        # what is left, for the progress bar
    with run.log("done-0000.jsonl", workers) as log:
        for name, record in produce_what_is_left():   # each file durable before its journal line
            log.add(record)
            run.wrote(name, bytes_in)
    run.finish(every_file, size_of, write_last)   # all journalled? then side files and the marker, last
    return run.done()

A file counts as done only once its journal line is fsynced (OUT/.kconvert/), so a killed run (SIGKILL,
Ctrl-C, a full disk) is resumed by the same command. The marker (kconvert.json; an export's index) is
written last and atomically: its presence means complete. The journal is removed after it.
Also here: how many worker threads a run uses, and the per-run thread and collector settings.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kconvert.arguments import path_name
from kconvert import distributed
from kconvert.errors import KConvertError
from kconvert.host_memory import available_memory, peak_rss_bytes
from kconvert.disk_format.journal import JOURNAL_DIR, JournalLog, read_done
from kconvert.convert.output_dir import prepare_out
from kconvert.io.gc_pause import frozen_gc


@dataclass
class ShardFigures:
    """`shard`'s own figures."""

    per_rank_bytes: dict[int, int] = field(default_factory=dict)  # global rank -> bytes it stores
    processes: int | None = None  # the processes that wrote it together (torchrun); None: nothing was run
    calibration: dict | None = None  # --calibrate: the calibration's record and its per-layer figures
    # exact casts (nvfp4 from MXFP4), per tensor kind: {"exact": blocks kept exactly, "data_derived": blocks rounded}
    exact_casts: dict | None = None


@dataclass
class ExportFigures:
    """`export`'s own figures."""

    format: str
    files: int = 0
    tensors: int = 0
    quantized: int = 0  # tensors stored quantized (not copied, not kept in bf16)
    dequantized: int = 0  # tensors stored quantized in the source, written BF16
    rounded: int = 0  # of those, tensors whose values BF16 does not hold exactly (rounded to nearest)
    workers: int = 0
    calibration: dict | None = None


@dataclass
class PackFigures:
    """`pack` / `unpack`'s own figures, under the names `kconvert pack --json` has always printed."""

    op: str  # pack | unpack
    untouched: int = 0  # files already in the wanted form
    files: int = 0  # converted by this run
    resumed: int = 0  # converted by an interrupted run
    plain_bytes: int = 0  # of the files converted
    stored_bytes: int = 0  # their size afterwards


@dataclass
class RunResult:
    """What a run did: the figures every journalled command has, and its own (`details`: ShardFigures,
    ExportFigures or PackFigures). `--json` prints both as one flat object (a figure that is None left out)."""

    out: str
    files_written: int = 0  # by this run
    files_resumed: int = 0  # finished by an interrupted run
    bytes_in: int = 0
    bytes_out: int = 0
    seconds: float = 0.0
    peak_rss_bytes: int = 0
    already_complete: bool = False  # nothing was left to do
    details: ShardFigures | ExportFigures | PackFigures | None = None
    # what the source holds that a consumer would misread though this run read it right (one line each)
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        doc = asdict(self)
        details = doc.pop("details") or {}
        if not doc["warnings"]:
            del doc["warnings"]
        return {**doc, **{k: v for k, v in details.items() if v is not None}}


class Run:
    """One run into `out`: its clock, result, progress events, journal and completion."""

    def __init__(self, out: str | Path, progress=None, *, logs: str = "done-*.jsonl",
                 details: ShardFigures | ExportFigures | PackFigures | None = None):
        self.t0 = time.perf_counter()
        self.out = Path(path_name(out, "OUT")).resolve()  # a 256-byte name fails at the first write otherwise
        self.progress = progress
        self.logs = logs  # the journal files this run (and its other processes) append to
        self.result = RunResult(str(self.out), details=details)
        self._recorded: dict[bytes, dict] = {}  # journal line -> the record this process wrote as it (JournalLog)

    def prepare(self, identity: dict, overwrite: bool, *, group: distributed.Group | None = None, **marker) -> bool:
        """Make OUT ready (output_dir.prepare_out, `marker` its marker / job_of); True when it already holds
        this job, complete. Under several processes the first prepares OUT and the others follow it."""
        if group is None or group.rank == 0:
            state = prepare_out(self.out, identity, overwrite, **marker)
        if group is not None:
            group.barrier()
            if group.rank != 0:
                state = prepare_out(self.out, identity, overwrite=False, follower=True, **marker)
        if state != "complete":
            return False
        self.result.already_complete = True
        self.result.seconds = time.perf_counter() - self.t0
        return True

    def journalled(self, size_of: Callable[[dict], int | None]) -> dict[str, dict]:
        """{file: journal record} of the files recorded finished (by any process) whose bytes are still there."""
        return read_done(sorted((self.out / JOURNAL_DIR).glob(self.logs)), self.out, size_of, self._recorded)

    def start(self, total_bytes: int) -> None:
        if self.progress:
            self.progress("start", total=total_bytes)

    @contextlib.contextmanager
    def log(self, name: str, workers: int | None = None, threads: int | None = None):
        """The journal file this process appends to; with `workers`, the worker-thread settings too
        (`threads`: torch's threads, else the cores shared among the workers)."""
        with JournalLog(self.out / JOURNAL_DIR / name, self._recorded) as log, \
                (worker_runtime(workers, threads) if workers else contextlib.nullcontext()):
            yield log

    def wrote(self, name: str, bytes_in: int = 0, *, durable_bytes: int | None = None) -> None:
        """`name` is durable and journalled: only now does the bar count its bytes (`durable_bytes`, else
        `bytes_in`), so it never reads 100 % while a file can still be lost."""
        self.result.files_written += 1
        self.result.bytes_in += bytes_in
        if self.progress:
            self.progress("advance", n=bytes_in if durable_bytes is None else durable_bytes)
            self.progress("file", path=name)

    def finish(self, expected: list[str], size_of: Callable[[dict], int | None], write_last: Callable[[dict], object]):
        """Every expected file must be journalled (else an error that says to re-run); then `write_last(done)`
        copies side files and writes the marker, and the journal goes. Returns what `write_last` returns."""
        done = self.journalled(size_of)
        missing = [f for f in expected if f not in done]
        if missing:
            raise KConvertError(f"{len(missing)} files were not produced (first: {missing[0]}); re-run to resume",
                                file=str(self.out))
        value = write_last(done)
        shutil.rmtree(self.out / JOURNAL_DIR, ignore_errors=True)
        return value

    def done(self) -> RunResult:
        self.result.seconds = time.perf_counter() - self.t0
        self.result.peak_rss_bytes = peak_rss_bytes()
        return self.result


# Worker threads: I/O (reads, fsync) overlaps with quantization, so one more than the cores pays; each
# worker holds its tensors plus float32 temporaries, and all of them together stay within MEMORY_SHARE
# of the available memory (and MAX_WORKERS: beyond it the disk, not the CPU, is the limit).
MEMORY_SHARE = 0.25
MAX_WORKERS = 8
WORKER_BYTES_PER_SOURCE_BYTE = {False: 3, True: 4}  # plain copy vs quantize (chunked: + output, scales)


def default_workers(largest_tensor_bytes: int, quantized: bool) -> int:
    """Workers for a conversion whose largest source tensor is `largest_tensor_bytes`."""
    per_worker = max(1, largest_tensor_bytes) * WORKER_BYTES_PER_SOURCE_BYTE[quantized]
    by_memory = int(available_memory() * MEMORY_SHARE) // per_worker
    return max(1, min(cores() + 1, MAX_WORKERS, by_memory))


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@contextlib.contextmanager
def worker_runtime(workers: int, threads: int | None = None):
    """The workers are the parallelism: torch's own threads would oversubscribe the cores (small
    chunked ops spin-wait on busy cores), so each worker runs its ops on one thread unless there
    are fewer workers than cores. The objects alive before the conversion (torch, the plan) are
    frozen out of the cycle collector, which the conversion's many short-lived tensors trigger
    (measured: about 4 % of the CPU time went to rescanning them); a caller that froze them itself (shard,
    io/gc_pause.frozen_gc) keeps its freeze."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads or max(1, cores() // max(1, workers)))
    try:
        with frozen_gc():
            yield
    finally:
        torch.set_num_threads(before)
