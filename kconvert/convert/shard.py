"""`kconvert shard`: execute a conversion plan, streaming, resumable, optionally over many processes.

Each work item (rank, unit) is produced tensor by tensor: a reader thread fetches the next source
slice while the current one is quantized and written (bounded to two in flight), so memory depends
on the largest tensor, not on the model. Finished files are recorded in a journal (OUT/.kconvert/);
a re-run with the same job resumes after the last recorded file, and kconvert.json is written last.
Under torchrun, process p takes units (layers) p, p + P, p + 2P, ...; process 0 writes kconvert.json.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kconvert import __version__
from kconvert.source.checkpoint import Checkpoint
from kconvert.converted.format import FORMAT, FORMAT_VERSION, JOURNAL_DIR, MANIFEST, stored_bytes
from kconvert.errors import KConvertError, UsageError
from kconvert.convert.layout import Layout
from kconvert.convert.quant_policy import FP8_BLOCK, QuantPolicy
from kconvert.convert.quantize import check_finite, quantize_fp8_block, quantize_int4_group, quantize_int8_channel
from kconvert.io.safetensors_read import read_tensor
from kconvert.io.atomic import write_atomic
from kconvert.io.safetensors_write import SafetensorsWriter, WrittenFile
from kconvert.convert.shard_plan import Output, WorkItem, plan_items
from kconvert import distributed

COPY_PATTERNS = ("config.json", "generation_config.json", "tokenizer_config.json", "tiktoken.model", "*.tiktoken",
                 "special_tokens_map.json", "chat_template.jinja", "preprocessor_config.json", "processor_config.json")


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
    workers: int = 1
    overwrite: bool = False
    compress: str | None = None  # "zstd[:LEVEL]": compressed shards (a storage form, not part of identity())
    group_size: int = 32  # int4
    int4_scales: str = "mse"  # int4

    def identity(self, fingerprint: str, layout: Layout) -> dict:
        """What must match for two runs to write into the same directory."""
        return {"source_fingerprint": fingerprint, "tp": layout.tp, "ep": layout.ep, "quant": self.quant,
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


def shard(job: ShardJob, progress=None) -> ShardResult:
    """Run `job`. `progress(event, **kw)` gets ("start", total=bytes), ("advance", n=bytes), ("file", path=...)."""
    t0 = time.perf_counter()
    out = Path(job.out).resolve()
    ck = Checkpoint.open(job.src)
    _check_paths(ck, out)
    layout = Layout.make(job.tp, job.ep)
    policy = QuantPolicy(job.quant, job.keep, job.force, job.scale_format, job.group_size, job.int4_scales)
    items = plan_items(ck, layout, policy, requantize=job.requantize, keep_mtp=job.keep_mtp)
    identity = job.identity(ck.fingerprint(), layout)
    result = ShardResult(str(out))
    level = None
    if job.compress:
        from kconvert.io.compressed import parse_codec

        level = parse_codec(job.compress)[1]

    dist = distributed.Group.from_env()
    if dist.rank == 0:
        state = _prepare_out(out, identity, job.overwrite)
    dist.barrier()
    if dist.rank != 0:
        state = _prepare_out(out, identity, overwrite=False, follower=True)
    if state == "complete":
        result.already_complete = True
        result.seconds = time.perf_counter() - t0
        return result

    journal = out / JOURNAL_DIR
    done = _read_journal(journal, out)
    by_unit: dict[str, list[WorkItem]] = {}
    for w in items:  # items come in unit order; process p takes units p, p + P, ...
        by_unit.setdefault(w.unit, []).append(w)
    mine = [b for i, b in enumerate(by_unit.values()) if i % dist.world == dist.rank]
    batches = [todo for b in mine if (todo := [w for w in b if w.file not in done])]
    result.files_resumed = sum(len(b) for b in mine) - sum(len(b) for b in batches)
    todo = [w for b in batches for w in b]
    if progress:
        progress("start", total=sum(w.bytes_in for w in todo))
    log = open(journal / f"done-{dist.rank:04d}.jsonl", "a")
    try:
        with ThreadPoolExecutor(max(1, job.workers)) as pool:
            for batch, recs in zip(batches, pool.map(lambda b: _run_unit(ck, b, out, progress, level), batches)):
                for w, (rec, stored) in zip(batch, recs):
                    entry = {"file": w.file, "bytes": rec.bytes, "crc32": rec.crc32, "tensors": rec.tensor_crc32}
                    if stored:
                        entry["stored"] = stored
                    log.write(json.dumps(entry) + "\n")
                    log.flush()
                    os.fsync(log.fileno())
                    result.files_written += 1
                    result.bytes_in += w.bytes_in
                    if progress:
                        progress("file", path=w.file)
    finally:
        log.close()
    dist.barrier()
    if dist.rank == 0:
        _finish(ck, out, items, identity, layout, policy, job)
    dist.barrier()
    meta = json.loads((out / MANIFEST).read_text())
    for rel, rec in meta["files"].items():
        result.per_rank_bytes[rec["rank"]] = result.per_rank_bytes.get(rec["rank"], 0) + stored_bytes(rec)
    result.bytes_out = sum(result.per_rank_bytes.values())
    result.seconds = time.perf_counter() - t0
    result.peak_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return result


# --------------------------------------------------------------------------- one work item


def _run_unit(ck: Checkpoint, batch: list[WorkItem], out: Path, progress,
              level: int | None = None) -> list[tuple[WrittenFile, dict | None]]:
    """Write every rank's file of one unit (a layer, globals or vision) in one pass over the source:
    each source tensor is read once, and each rank's slice of it goes to that rank's file. Memory:
    the tensor being written plus the one read ahead. With a zstd `level`, each committed file is
    then compressed in place (temp + fsync + rename) before the caller journals it."""
    writers = []
    try:
        for w in batch:
            path = out / w.file
            for stale in path.parent.glob(f".{path.name}.tmp-*"):
                stale.unlink(missing_ok=True)  # left by a killed run
            writers.append(SafetensorsWriter(path, w.specs(), {"format": "pt", "kconvert_rank": str(w.rank),
                                                               "kconvert_unit": w.unit}))
        # source tensor -> [(writer, output)], in the name order every file's header was planned in
        by_src: dict[str, list[tuple[SafetensorsWriter, Output]]] = {}
        for writer, w in zip(writers, batch):
            for o in w.outputs:
                by_src.setdefault(o.src, []).append((writer, o))
        order = sorted(by_src)
        with ThreadPoolExecutor(1) as reader:  # read-ahead of one source tensor: two in flight at most
            ahead = reader.submit(_load, ck, by_src[order[0]][0][1]) if order else None
            for i, src in enumerate(order):
                x = ahead.result()
                ahead = reader.submit(_load, ck, by_src[order[i + 1]][0][1]) if i + 1 < len(order) else None
                for writer, o in by_src[src]:
                    try:
                        for name, tensor in _produce(o, _slice(ck, o, x)):
                            writer.write(name, tensor)
                    except KConvertError as e:
                        e.file = e.file or str(ck.logical[o.src].main.file)
                        raise
                    if progress:
                        progress("advance", n=o.bytes_in)
                del x
        written = [wr.commit() for wr in writers]
    except BaseException:
        for wr in writers:
            wr.abort()
        raise
    if level is None:
        return [(rec, None) for rec in written]
    from kconvert.io.compress_file import compress_file

    return [(rec, compress_file(rec.path, rec.path, level=level, threads=min(8, os.cpu_count() or 1),
                                expect_crc32=rec.crc32).record()) for rec in written]


def _load(ck: Checkpoint, o: Output):
    """The whole source tensor of `o`: dequantized/plain, or (fp8 weight, scale) for lossless copies."""
    t = ck.logical[o.src]
    if o.transform == "fp8_copy":
        return read_tensor(t.parts["weight"]), read_tensor(t.parts["scale"])
    return ck.read(o.src)


def _slice(ck: Checkpoint, o: Output, x):
    p = o.piece
    if p.dim is None:
        return x
    if o.transform == "fp8_copy":
        b = ck.quant_block()[p.dim]
        w, s = x
        return (w.narrow(p.dim, p.start, p.stop - p.start).contiguous(),
                s.narrow(p.dim, p.start // b, -(-p.stop // b) - p.start // b).contiguous())
    return x.narrow(p.dim, p.start, p.stop - p.start).contiguous()


def _produce(o: Output, x):
    if o.transform == "fp8_copy":
        yield o.src, x[0]
        yield o.src + "_scale_inv", x[1].to(torch.float32)
        return
    if o.transform in ("fp8", "int8", "int4"):
        check_finite(x, o.src)
        if o.transform == "int4":
            q, s = quantize_int4_group(x, o.group_size, o.int4_scales)
            yield o.src + "_packed", q
            yield o.src + "_scale", s
        elif o.transform == "fp8":
            q, s = quantize_fp8_block(x, FP8_BLOCK, o.scale_format)
            yield o.src, q
            yield o.src + "_scale_inv", s
        else:
            q, s = quantize_int8_channel(x)
            yield o.src, q
            yield o.src + "_scale", s
        return
    yield o.src, (x.to(torch.bfloat16) if o.transform == "bf16" else x).contiguous()


# --------------------------------------------------------------------------- output directory state


def _check_paths(ck: Checkpoint, out: Path) -> None:
    src = ck.root.resolve()
    if out == src or src in out.parents:
        raise UsageError("the output directory is inside the source checkpoint; choose a path outside it", file=str(out))
    if out.exists() and not out.is_dir():
        raise UsageError("output path exists and is not a directory", file=str(out))


def _prepare_out(out: Path, identity: dict, overwrite: bool, follower: bool = False) -> str:
    """Make `out` ready for this job: 'fresh', 'resume' or 'complete'. Refuses to mix jobs."""
    journal = out / JOURNAL_DIR
    job_file = journal / "job.json"
    if (out / MANIFEST).exists():
        meta = json.loads((out / MANIFEST).read_text())
        if meta.get("job") == identity and not overwrite:
            return "complete"
        if not overwrite:
            raise UsageError("the output directory holds a different conversion (other source or arguments); "
                             "pass --overwrite to replace it or choose another directory", file=str(out))
    elif job_file.exists():
        if json.loads(job_file.read_text()) == identity:
            return "resume"
        if not overwrite and not follower:
            raise UsageError("the output directory holds an unfinished conversion with other arguments or another "
                             "source; re-run that command to finish it, or pass --overwrite", file=str(out))
    elif out.exists() and any(out.iterdir()) and not follower:
        raise UsageError("the output directory is not empty and holds no kconvert conversion; choose an empty one",
                         file=str(out))
    if follower:
        return "resume"
    if overwrite and out.exists():
        if not ((out / MANIFEST).exists() or job_file.exists() or not any(out.iterdir())):
            raise UsageError("refusing to --overwrite a directory that is not a kconvert output", file=str(out))
        shutil.rmtree(out)
    try:
        journal.mkdir(parents=True, exist_ok=True)
        write_atomic(job_file, json.dumps(identity, indent=1).encode())
    except PermissionError:
        raise UsageError("the output directory is not writable", file=str(out)) from None
    except OSError as e:
        raise UsageError(f"cannot create the output directory: {e.strerror}", file=str(out)) from None
    return "fresh"


def _read_journal(journal: Path, out: Path) -> dict[str, dict]:
    """Files recorded finished whose bytes are still there (a torn last line is ignored)."""
    done: dict[str, dict] = {}
    for log in sorted(journal.glob("done-*.jsonl")):
        for line in log.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            path = out / rec["file"]
            if path.is_file() and path.stat().st_size == stored_bytes(rec):
                done[rec["file"]] = rec
    return done


def _finish(ck: Checkpoint, out: Path, items: list[WorkItem], identity: dict, layout: Layout, policy: QuantPolicy,
            job: ShardJob) -> None:
    done = _read_journal(out / JOURNAL_DIR, out)
    missing = [w.file for w in items if w.file not in done]
    if missing:
        raise KConvertError(f"{len(missing)} files were not produced (first: {missing[0]}); re-run to resume",
                            file=str(out))
    for pattern in COPY_PATTERNS:
        for f in sorted(ck.root.glob(pattern)):
            shutil.copyfile(f, out / f.name)
    files, tensors = {}, []
    for w in items:
        rec = done[w.file]
        layer = int(w.unit.split("-")[1]) if w.unit.startswith("layer-") else None
        files[w.file] = {"rank": w.rank, "unit": w.unit, "layer": layer, "bytes": rec["bytes"], "crc32": rec["crc32"]}
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
    meta = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "created_by": f"kconvert {__version__}",
        "job": identity,
        "source": {"path": str(ck.source), "fingerprint": identity["source_fingerprint"], "family": ck.family},
        "config": ck.config,
        "layout": {"tp": layout.tp, "ep": layout.ep, "world_size": layout.tp,
                   "experts": "whole" if layout.expert_tp == 1 else "split",
                   "units": ["globals"] + (["vision"] if any(w.unit == "vision" for w in items) else []) +
                   sorted({w.unit for w in items if w.unit.startswith("layer-")})},
        "quantization": {"scheme": policy.scheme, "block_size": [128, 128] if policy.scheme == "fp8" else None,
                         "scale_format": policy.scale_format, "keep": list(policy.keep), "quantize": list(policy.force),
                         "requantize": job.requantize, "mtp_layers": "kept" if job.keep_mtp else "dropped",
                         **({"group_size": policy.group_size, "int4_scales": policy.int4_scales}
                            if policy.scheme == "int4" else {})},
        "files": files,
        "tensors": tensors,
    }
    write_atomic(out / MANIFEST, json.dumps(meta, indent=1).encode())
    shutil.rmtree(out / JOURNAL_DIR, ignore_errors=True)
