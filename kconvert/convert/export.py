"""`kconvert export`: a Hugging Face-layout checkpoint in a format serving engines load as it is
(formats: export_formats.py; formulas: docs/EXPORT.md).

Streaming: tensors are read, quantized and handed to the writer by a pool of workers, a bounded window
ahead of the one thread that writes them in file order (memory: the window's tensors, never the model).
Files are `model-0000K-of-0000N.safetensors` (at most --max-shard-size each), written under temporary
names and journalled when complete (OUT/.kconvert/), so a re-run resumes; config.json and then
model.safetensors.index.json are written last: without the index, an unfinished export looks like no
checkpoint at all. The index's metadata records the job and each file's size and CRC-32.
"""

from __future__ import annotations

import json
import resource
import shutil
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from kconvert import __version__
from kconvert.errors import KConvertError, UsageError
from kconvert.io.atomic import write_atomic
from kconvert.io.safetensors_write import SafetensorsWriter
from kconvert.source.checkpoint import INDEX, Checkpoint
from kconvert.converted.journal import JOURNAL_DIR, JournalLog, read_done
from kconvert.convert.export_formats import (FORMATS, Exported, ignore_list, load, plan_tensor, produce,
                                             quantization_config, source_scale_fmt)
from kconvert.convert.output_dir import COPY_PATTERNS, check_paths, copy_side_files, prepare_out
from kconvert.convert.shard import default_workers, worker_runtime

EXPORT_VERSION = 1
# Beyond shard's side files: what a serving engine or `trust_remote_code` needs from the release.
SIDE_PATTERNS = COPY_PATTERNS + ("tokenizer.json", "tokenizer.model", "*.py", "LICENSE*", "README.md")
DEFAULT_MAX_SHARD = 5 * 10**9


@dataclass(frozen=True)
class ExportJob:
    src: str
    out: str
    format: str
    group_size: int = 32
    scale_format: str | None = None  # fp8-block: fp32 | ue8m0; None = as the source stores it (else fp32)
    max_shard_bytes: int = DEFAULT_MAX_SHARD
    workers: int | None = None  # None: from the cores and the memory budget
    overwrite: bool = False

    def identity(self, fingerprint: str, scale_fmt: str) -> dict:
        return {"source_fingerprint": fingerprint, "format": self.format, "group_size": self.group_size,
                "scale_format": scale_fmt, "max_shard_bytes": self.max_shard_bytes, "export_version": EXPORT_VERSION}


@dataclass
class ExportResult:
    out: str
    format: str
    files: int = 0
    tensors: int = 0
    quantized: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    seconds: float = 0.0
    peak_rss_bytes: int = 0
    files_written: int = 0
    files_resumed: int = 0
    workers: int = 0
    already_complete: bool = False

    def to_json(self) -> dict:
        return asdict(self)


def shard_name(k: int, n: int) -> str:
    return f"model-{k:05d}-of-{n:05d}.safetensors"


def plan_export(ck: Checkpoint, job: ExportJob, scale_fmt: str) -> list[list[Exported]]:
    """Every exported tensor, in checkpoint order (embeddings, layers, the rest), cut into files."""
    ck.validate()
    if job.format not in FORMATS:
        raise UsageError(f"unknown --format {job.format!r} (choose from {', '.join(FORMATS)})")
    if job.group_size < 8 or job.group_size % 8:
        raise UsageError(f"--group-size {job.group_size} must be a positive multiple of 8")

    def order(name: str):
        info = ck.info(name)
        first = info.group == "text" and info.layer is None and info.component == "embed"
        in_layers = info.group == "text" and info.layer is not None
        return (0 if first else 1 if in_layers else 2, info.layer if in_layers else -1, name)

    files: list[list[Exported]] = [[]]
    size = 0
    for name in sorted(ck.logical, key=order):
        e = plan_tensor(ck, job.format, name, ck.logical[name], job.group_size, scale_fmt)
        if files[-1] and size + e.bytes_out > job.max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(e)
        size += e.bytes_out
    return files


def export(job: ExportJob, progress=None) -> ExportResult:
    """Run `job`. `progress(event, **kw)`: ("start", total=bytes), ("advance", n=bytes), ("file", path=...)."""
    t0 = time.perf_counter()
    out = Path(job.out).resolve()
    ck = Checkpoint.open(job.src)
    check_paths(ck, out)
    scale_fmt = job.scale_format or source_scale_fmt(ck)
    files = plan_export(ck, job, scale_fmt)
    names = [shard_name(k + 1, len(files)) for k in range(len(files))]
    identity = job.identity(ck.fingerprint(), scale_fmt)
    result = ExportResult(str(out), job.format, files=len(files), tensors=sum(map(len, files)),
                          quantized=sum(e.transform not in ("copy", "bf16") for f in files for e in f))
    state = prepare_out(out, identity, job.overwrite, marker=INDEX,
                        job_of=lambda meta: (meta.get("metadata") or {}).get("kconvert_job"))
    if state == "complete":
        result.already_complete = True
        result.seconds = time.perf_counter() - t0
        return result
    done = _journalled(out)
    todo = [(name, f) for name, f in zip(names, files) if name not in done]
    result.files_resumed = len(files) - len(todo)
    largest = max((e.bytes_in for f in files for e in f), default=1)
    result.workers = job.workers or default_workers(largest, quantized=result.quantized > 0)
    if progress:
        progress("start", total=sum(e.bytes_in for _, f in todo for e in f))
    with JournalLog(out / JOURNAL_DIR / "done-0000.jsonl") as log, worker_runtime(result.workers):
        for name, rec in _write_files(ck, out, todo, scale_fmt, result.workers, progress):
            log.add({"file": name, "bytes": rec.bytes, "crc32": rec.crc32, "tensors": rec.tensor_crc32})
            result.files_written += 1
            if progress:
                progress("file", path=name)
    result.bytes_in = sum(e.bytes_in for _, f in todo for e in f)
    _finish(ck, out, job, names, files, identity, scale_fmt)
    result.bytes_out = sum((out / n).stat().st_size for n in names)
    result.seconds = time.perf_counter() - t0
    result.peak_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return result


def _write_files(ck: Checkpoint, out: Path, todo, scale_fmt: str, workers: int, progress):
    """Yield (file name, WrittenFile) as each file commits. Workers read and quantize up to `workers + 1`
    tensors ahead of this thread, which writes them in order (reads, quantization and writes overlap)."""
    stream = [(name, k, e) for name, f in todo for k, e in enumerate(f)]
    sizes = {name: len(f) for name, f in todo}

    def make(e: Exported):
        try:
            return produce(e, load(ck, e), scale_fmt)
        except KConvertError as err:
            err.file = err.file or str(ck.logical[e.src].main.file)
            err.tensor = err.tensor or e.src
            raise

    writer = None
    with ThreadPoolExecutor(max(1, workers)) as pool:
        ahead: deque = deque()
        it = iter(stream)
        try:
            for name, k, e in stream:
                while len(ahead) < workers + 1 and (nxt := next(it, None)) is not None:
                    ahead.append(pool.submit(make, nxt[2]))
                tensors = ahead.popleft().result()
                if k == 0:
                    path = out / name
                    for stale in path.parent.glob(f".{path.name}.tmp-*"):
                        stale.unlink(missing_ok=True)  # left by a killed run
                    specs = [s for x in dict(todo)[name] for s in x.specs()]
                    writer = SafetensorsWriter(path, specs, {"format": "pt"})
                for (tname, _, _), t in zip(e.specs(), tensors):
                    writer.write(tname, t)
                del tensors
                if progress:
                    progress("advance", n=e.bytes_in)
                if k == sizes[name] - 1:
                    rec, writer = writer.commit(), None
                    yield name, rec
        except BaseException:
            for f in ahead:
                f.cancel()
            if writer is not None:
                writer.abort()
            raise


def _journalled(out: Path) -> dict[str, dict]:
    return read_done(sorted((out / JOURNAL_DIR).glob("done-*.jsonl")), out, lambda rec: rec.get("bytes"))


def _finish(ck: Checkpoint, out: Path, job: ExportJob, names: list[str], files: list[list[Exported]], identity: dict,
            scale_fmt: str) -> None:
    done = _journalled(out)
    missing = [n for n in names if n not in done]
    if missing:
        raise KConvertError(f"{len(missing)} files were not produced (first: {missing[0]}); re-run to resume",
                            file=str(out))
    copy_side_files(ck, out, SIDE_PATTERNS)
    kept = [ck.info(e.src) for f in files for e in f
            if e.transform in ("copy", "bf16") and len(e.shape) == 2 and ck.info(e.src).component not in ("embed", "norm")]
    quantized = [ck.info(e.src) for f in files for e in f if e.transform not in ("copy", "bf16")]
    qc = quantization_config(job.format, job.group_size, scale_fmt, ignore_list(kept, quantized))
    config = json.loads(json.dumps(ck.config))
    config["quantization_config"] = qc
    if isinstance(config.get("text_config"), dict):  # multimodal: the text model reads its own copy
        config["text_config"]["quantization_config"] = json.loads(json.dumps(qc))
    write_atomic(out / "config.json", (json.dumps(config, indent=2, sort_keys=True) + "\n").encode())
    weight_map, total = {}, 0
    for name, f in zip(names, files):
        for e in f:
            for tname, _, _ in e.specs():
                weight_map[tname] = name
            total += e.bytes_out
    index = {"metadata": {"total_size": total, "kconvert_job": identity, "created_by": f"kconvert {__version__}",
                          "source": str(ck.source),
                          "kconvert_files": {n: {"bytes": done[n]["bytes"], "crc32": done[n]["crc32"]} for n in names}},
             "weight_map": dict(sorted(weight_map.items()))}
    write_atomic(out / INDEX, (json.dumps(index, indent=2) + "\n").encode())
    shutil.rmtree(out / JOURNAL_DIR, ignore_errors=True)
