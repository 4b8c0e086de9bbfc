"""`kconvert export`: a Hugging Face-layout checkpoint in a format serving engines load as it is
(formats: export/formats.py; formulas: docs/EXPORT.md).

Streaming: tensors are read, quantized and handed to the writer by a pool of workers, a bounded window
ahead of the one thread that writes them in file order (memory: the window's tensors, never the model).
Files are `model-0000K-of-0000N.safetensors` (at most --max-shard-size each), written under temporary
names and journalled when complete (OUT/.kconvert/), so a re-run resumes; config.json and then
model.safetensors.index.json are written last: without the index, an unfinished export looks like no
checkpoint at all (the run's skeleton: run.py). The index's metadata records the job and each file's size
and CRC-32. Calibrated w4a16 (`calibrate`, as for shard: engine/calibrate/layerwise.py) quantizes one tensor at a
time in order, each layer's GPTQ codes computed when its first tensor comes up.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kconvert import __version__
from kconvert.errors import KConvertError, UsageError
from kconvert.io.atomic import write_atomic
from kconvert.io.safetensors_write import SafetensorsWriter
from kconvert.io.window import ordered_window
from kconvert.source.checkpoint import INDEX, Checkpoint
from kconvert.source.side_checks import check_side_files
from kconvert.disk_format.journal import JOURNAL_DIR
from kconvert.convert.export.formats import (Exported, exact_in_bf16, ignore_list, load, plan_tensor, produce,
                                             quantization_config, side_configs)
from kconvert.convert.export.table import EXPORT_FORMATS, FORMATS
from kconvert.quant.registry import CALIBRATED
from kconvert.source.stored_quant import source_fp8_block
from kconvert.convert.export import expert_dtype as v4_layout
from kconvert.convert.output_dir import COPY_PATTERNS, check_paths, config_json, copy_side_files
from kconvert.family.release_config import release_config
from kconvert.convert.run import ExportFigures, Run, RunResult, default_workers
from kconvert.convert.export.calibration_policy import ExportPolicy

EXPORT_VERSION = 1
# Beyond shard's side files: what a serving engine or `trust_remote_code` needs from the release.
SIDE_PATTERNS = COPY_PATTERNS + ("tokenizer.json", "tokenizer.model", "*.py", "LICENSE*", "README.md")
DEFAULT_MAX_SHARD = 5 * 10**9
MIN_SHARD = 10**6


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


def hf_file_name(k: int, n: int) -> str:
    """The K-th of N weight files of a Hugging Face checkpoint (1-based), as huggingface_hub names them."""
    return f"model-{k:05d}-of-{n:05d}.safetensors"


def plan_export(ck: Checkpoint, job: ExportJob, scale_fmt: str) -> list[list[Exported]]:
    """Every exported tensor, in checkpoint order (embeddings, layers, the rest), cut into files."""
    ck.validate()
    if job.format not in FORMATS:
        raise UsageError(f"unknown --format {job.format!r} (choose from {', '.join(FORMATS)})")
    if job.group_size < 8 or job.group_size % 8:
        raise UsageError(f"--group-size {job.group_size} must be a positive multiple of 8")
    if job.max_shard_bytes < MIN_SHARD:  # 0 used to write one file per tensor
        raise UsageError(f"--max-shard-size {job.max_shard_bytes} bytes: must be at least {MIN_SHARD // 10**6} MB")

    def order(name: str):
        info = ck.info(name)
        first = info.group == "text" and info.layer is None and info.component == "embed"
        in_layers = info.group == "text" and info.layer is not None
        return (0 if first else 1 if in_layers else 2, info.layer if in_layers else -1, name)

    files: list[list[Exported]] = [[]]
    size = 0
    experts = v4_layout.expert_dtype(ck, job.format)  # DeepSeek-V4's layout: its expert_dtype decides the scales
    for name in sorted(ck.logical, key=order):
        e = plan_tensor(ck, job.format, name, ck.logical[name], job.group_size, scale_fmt, experts)
        if files[-1] and size + e.bytes_out > job.max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(e)
        size += e.bytes_out
    if EXPORT_FORMATS[job.format].scheme and not any(e.scheme_name for f in files for e in f):  # e.g. a --group-size no input width divides
        group = f" --group-size {job.group_size}" if job.format == "w4a16" else ""
        raise UsageError(f"--format {job.format}{group} would quantize no tensor of this checkpoint (no eligible "
                         "linear's input width fits it): refusing to write an unquantized copy", file=str(ck.root))
    return files


def export(job: ExportJob, progress=None, calibrate=None) -> RunResult:
    """Run `job`. `progress(event, **kw)`: ("start", total=bytes), ("working", n=bytes) as tensors are made,
    ("advance", n=bytes) and ("file", path=...) as each file becomes durable.
    `calibrate(ck, policy, progress)`: makes the calibration of an int4 format (engine/calibrate/layerwise.py)."""
    run = Run(job.out, progress, details=ExportFigures(job.format))
    out = run.out
    ck = Checkpoint.open(job.src)
    check_paths(ck, out)
    check_side_files(ck)  # what the engine reads at run time (tokenizer, chat template, Engram map), before any work
    release_config(ck.config, ck.model.family)  # a config with no release spelling: refused before any work
    scale_fmt = v4_layout.scale_format(ck, job.scale_format, v4_layout.expert_dtype(ck, job.format))
    files = plan_export(ck, job, scale_fmt)
    run.result.warnings += filter(None, [v4_layout.source_disagreement(ck)])
    names = [hf_file_name(k + 1, len(files)) for k in range(len(files))]
    identity = job.identity(ck.fingerprint(), scale_fmt)
    calibration = None
    if calibrate is not None:
        scheme = EXPORT_FORMATS[job.format].scheme
        if scheme not in CALIBRATED:
            raise UsageError(f"--calibrate computes int4 and nvfp4 codes (GPTQ); --format {job.format} has nothing to "
                             "calibrate")
        calibrated = None if scheme == "int4" else \
            frozenset(e.src for f in files for e in f if e.scheme_name == scheme and e.copy is None)
        calibration = calibrate(ck, ExportPolicy(job.format, job.group_size, calibrated=calibrated), progress)
        identity["calibration"] = calibration.record
    result = run.result
    figures = result.details
    figures.files, figures.tensors = len(files), sum(map(len, files))
    figures.quantized = sum(e.transform not in ("copy", "bf16") for f in files for e in f)
    figures.dequantized = sum(e.transform == "bf16" for f in files for e in f)
    if run.prepare(identity, job.overwrite, marker=INDEX,
                   job_of=lambda meta: (meta.get("metadata") or {}).get("kconvert_job")):
        return result
    done = run.journalled(_journalled_size)
    todo = [(name, f) for name, f in zip(names, files) if name not in done]
    if calibration is not None:
        calibration.attach(out / JOURNAL_DIR / "calibration", identity)
    bytes_of = {name: sum(e.bytes_in for e in f) for name, f in todo}
    result.files_resumed = len(files) - len(todo)
    largest = max((e.bytes_in for f in files for e in f), default=1)
    workers = figures.workers = 1 if calibration else \
        job.workers or default_workers(largest, quantized=figures.quantized > 0)
    resume_from = _first_layer_after(ck, todo)
    run.start(sum(bytes_of.values()))
    with run.log("done-0000.jsonl", workers) as log:
        rounded: list[str] = []
        for name, rec in _write_files(ck, out, todo, scale_fmt, workers, progress, calibration, rounded):
            log.add({"file": name, "bytes": rec.bytes, "crc32": rec.crc32, "tensors": rec.tensor_crc32})
            run.wrote(name, bytes_of[name])
            if calibration is not None:
                calibration.done_before(resume_from[name])
        figures.rounded = len(rounded)  # of this run's files (a resumed run counts what it wrote)
    run.finish(names, _journalled_size,
               lambda done: _write_index(ck, out, job, names, files, identity, scale_fmt, done))
    result.bytes_out = sum((out / n).stat().st_size for n in names)
    if calibration is not None:
        figures.calibration = {**calibration.record, "layers": calibration.figures}
    return run.done()


def _layer(ck: Checkpoint, name: str) -> int | None:
    info = ck.info(name)
    return info.layer if info.group == "text" else None


def _first_layer_after(ck: Checkpoint, todo) -> dict[str, int]:
    """{file: the first decoder layer a tensor of a later file belongs to} (past the last layer: a big number)."""
    after, first = {}, 1 << 30
    for name, f in reversed(todo):
        after[name] = first
        first = min([first] + [L for e in f if (L := _layer(ck, e.src)) is not None])
    return after


def _write_files(ck: Checkpoint, out: Path, todo, scale_fmt: str, workers: int, progress, calibration=None,
                 rounded: list | None = None):
    """Yield (file name, WrittenFile) as each file commits. Workers read and quantize up to `workers + 1`
    tensors ahead of this thread, which writes them in order (reads, quantization and writes overlap). `rounded`
    gets the name of each tensor dequantized to BF16 whose values BF16 does not hold exactly."""
    stream = [(name, k, e) for name, f in todo for k, e in enumerate(f)]
    sizes = {name: len(f) for name, f in todo}

    def make(entry):
        e = entry[2]
        try:
            if calibration is not None and e.scheme is not None and e.copy is None:
                L = _layer(ck, e.src)
                codes = calibration.layer(L) if L is not None else {}
                if e.src in codes:
                    return e.scheme.encode(*codes[e.src], e.options)
            x = load(ck, e)
            made = produce(e, x)
            if rounded is not None and e.transform == "bf16" and not exact_in_bf16(x, made[0]):
                rounded.append(e.src)
            return made
        except KConvertError as err:
            err.file = err.file or str(ck.logical[e.src].main.file)
            err.tensor = err.tensor or e.src
            raise

    writer = None
    with ThreadPoolExecutor(max(1, workers)) as pool, ordered_window(pool, make, stream, workers + 1) as made:
        try:
            for (name, k, e), tensors in made:
                if k == 0:
                    path = out / name
                    for stale in path.parent.glob(f".{path.name}.tmp-*"):
                        stale.unlink(missing_ok=True)  # left by a killed run
                    specs = [s for x in dict(todo)[name] for s in x.specs()]
                    writer = SafetensorsWriter(path, specs, {"format": "pt"})
                for (tname, _, _), t in zip(e.specs(), tensors):
                    writer.write(tname, t)
                del tensors
                if progress:  # in flight: the bar counts a file's bytes when it is durable (Run.wrote)
                    progress("working", n=e.bytes_in)
                if k == sizes[name] - 1:
                    rec, writer = writer.commit(), None
                    yield name, rec
        except BaseException:
            if writer is not None:
                writer.abort()
            raise


def _journalled_size(rec: dict) -> int | None:
    return rec.get("bytes")


def _write_index(ck: Checkpoint, out: Path, job: ExportJob, names: list[str], files: list[list[Exported]],
                 identity: dict, scale_fmt: str, done: dict[str, dict]) -> None:
    """Side files, config.json with its quantization_config, then the index (last: it marks the export complete)."""
    copy_side_files(ck, out, SIDE_PATTERNS)
    kept = [ck.info(e.src) for f in files for e in f
            if e.transform in ("copy", "bf16") and len(e.shape) == 2 and ck.info(e.src).component not in ("embed", "norm")]
    quantized = [ck.info(e.src) for f in files for e in f if e.transform not in ("copy", "bf16")]
    experts = v4_layout.expert_dtype(ck, job.format)  # None unless the export is in DeepSeek-V4's layout
    encoding = v4_layout.encoding(ck, job.format, experts)
    qc = quantization_config(job.format, job.group_size, v4_layout.config_scale_fmt(encoding, scale_fmt),
                             ignore_list(kept, quantized), source_fp8_block(ck.quantization_config),
                             [(e.src, e.scheme_name) for f in files for e in f if e.transform not in ("copy", "bf16")],
                             encoding)
    if experts and "expert_dtype" in ck.quantization_config:  # where the source spells it (V4.1's release)
        qc["expert_dtype"] = experts
    outside = sorted({i.name[: -len(".weight")] for i in kept if i.group != "text" and i.name.endswith(".weight")})
    if qc and qc.get("quant_method") == "fp8" and outside:
        # the linears outside the text model (kept bf16), by exact module name: vLLM's Fp8Config (and transformers')
        # would build Kimi-K2.5's vision tower and projector in FP8 (their bf16 weights loaded into FP8 parameters,
        # the scales missing); the text model's own bf16 linears are the release's, which vLLM's model code exempts
        qc["modules_to_not_convert"] = outside
    config = release_config(ck.config, ck.model.family)  # the keys serving engines read, as the release spells them
    sections = [config] + ([config["text_config"]] if isinstance(config.get("text_config"), dict) else [])
    for section in sections:  # multimodal: the text model reads its own copy
        if qc is None:  # unquantized (bf16): no quantization_config, no expert storage to name
            section.pop("quantization_config", None)
            section.pop("expert_dtype", None)
        else:
            section["quantization_config"] = json.loads(json.dumps(qc))
    if experts:  # DeepSeek-V4 readers take the routed experts' storage, and vLLM every FP8 scale's dtype, from it
        key = ck.model.family.get("text_config", ".")
        text = config if key == "." else config[key]
        text["expert_dtype"] = experts
        if "expert_dtype" in config:  # a top-level copy too (vLLM's V4.1 config takes it over the text config's)
            config["expert_dtype"] = experts
    for side, doc in side_configs(job.format, qc).items():  # (nvfp4: ModelOpt's hf_quant_config.json)
        write_atomic(out / side, (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode())
    write_atomic(out / "config.json", config_json(config))
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
