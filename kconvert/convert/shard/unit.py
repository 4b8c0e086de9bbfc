"""One unit of `kconvert shard` (a layer, globals or vision), every rank's file of it in one pass over
the source: each source tensor is read once (a reader thread fetches the next while the current one is
sliced, quantized and written: two in flight at most), and each rank's slice goes to that rank's file.
`write_unit` leaves the files finished but not yet durable (the caller commits a unit's files together,
off the worker: safetensors_write.commit_all); `run_unit` also commits them (and compresses them)."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from itertools import chain, repeat
from pathlib import Path

from kconvert.errors import CheckpointError, KConvertError, WriteError
from kconvert.io.safetensors_write import SafetensorsWriter, WrittenFile, commit_all
from kconvert.source.checkpoint import Checkpoint
from kconvert.source.stored_parts import read_parts
from kconvert.convert.fused import tensor_scales
from kconvert.convert.shard.outputs import Output, WorkItem
from kconvert.convert.shard.stacks import Pairs, plan_jobs, write_stack
from kconvert.quant.scheme import Options, stored_output
from kconvert.quant.stacking import NotStackable
from kconvert.quant.tally import counting, merged


def run_unit(ck: Checkpoint, batch: list[WorkItem], out: Path, progress,
             level: int | None = None, codes: dict | None = None) -> list[tuple[WrittenFile, dict | None]]:
    """write_unit, then commit the unit's files. With a zstd `level`, each committed file is then
    compressed in place (temp + fsync + rename) before the caller journals it."""
    written = commit_all(write_unit(ck, batch, out, progress, codes))
    if level is None:
        return [(rec, None) for rec in written]
    from kconvert.io.compress_file import compress_file

    return [(rec, compress_file(rec.path, rec.path, level=level, threads=min(8, os.cpu_count() or 1),
                                expect_crc32=rec.crc32).record()) for rec in written]


def write_unit(ck: Checkpoint, batch: list[WorkItem], out: Path, progress,
               codes: dict | None = None) -> list[SafetensorsWriter]:
    """Write every rank's file of one unit (a layer, globals or vision) in one pass over the source:
    each source tensor is read once, and each rank's slice of it goes to that rank's file. Small weights
    of one shape go as stacks (shard_stacks.py); if a stack fails a check, the unit is written again one
    weight at a time, which names the bad tensor as it always has. `codes`: {source name: (codes, scale, ...)}
    computed already (calibrated int4 or nvfp4), stored instead of quantizing. Memory: the tensor (or
    stack) being written plus the one read ahead. Returns the finished writers (bytes written,
    writeback started, not yet durable: commit_all them before journalling)."""
    writers, by_src = _open(batch, out)
    try:
        order = sorted(by_src)
        jobs = plan_jobs(ck, order, by_src, codes)
        if not all(isinstance(job, str) for job in jobs):  # any stack
            try:
                _write_jobs(ck, jobs, by_src, progress, codes, fixed_scales(ck, order, by_src))
                return _finish(writers)
            except WriteError:
                raise
            except (CheckpointError, NotStackable, OSError):  # a source problem: the one-by-one pass meets
                _abort(writers)  # it in the order, and with the words, it always has
                writers, by_src = _open(batch, out)
        _write_each(ck, order, by_src, progress, codes, fixed_scales(ck, order, by_src))
        return _finish(writers)
    except BaseException:
        _abort(writers)
        raise


def _open(batch: list[WorkItem], out: Path) -> tuple[list[SafetensorsWriter], dict[str, Pairs]]:
    """Every file of the unit opened, and source tensor -> [(writer, output)] in the name order every
    file's header was planned in."""
    writers = []
    try:
        for w in batch:  # (what a killed run left of these files is gone: output_dir.remove_stale_temporaries)
            writers.append(SafetensorsWriter(out / w.file, w.specs(), {"format": "pt", "kconvert_rank": str(w.rank),
                                                                       "kconvert_unit": w.unit}))
    except BaseException:
        _abort(writers)
        raise
    srcs = [o.src for w in batch for o in w.outputs]
    if len(set(srcs)) == len(srcs):  # each source tensor goes to one file (experts placed whole: ep = tp): at once
        pairs = chain.from_iterable(zip(repeat(writer), w.outputs) for writer, w in zip(writers, batch))
        return writers, dict(zip(srcs, zip(pairs)))  # (a 1-tuple of its pair each)
    by_src: dict[str, Pairs] = {}
    for writer, w in zip(writers, batch):
        for o in w.outputs:
            by_src.setdefault(o.src, []).append((writer, o))
    return writers, by_src


def _finish(writers: list[SafetensorsWriter]) -> list[SafetensorsWriter]:
    for wr in writers:
        wr.finish()
    return writers


def _abort(writers: list[SafetensorsWriter]) -> None:
    for wr in writers:
        wr.abort()


def _write_jobs(ck: Checkpoint, jobs: list[str | list[str]], by_src: dict[str, Pairs], progress, codes,
                fixed: dict[str, float]) -> None:
    """plan_jobs' jobs: stacks as stacks, each run of lone weights between them one at a time."""
    alone: list[str] = []
    for job in [*jobs, []]:
        if isinstance(job, str):
            alone.append(job)
            continue
        if alone:
            _write_each(ck, alone, by_src, progress, codes, fixed)
            alone = []
        if job:
            n = write_stack(ck, job, by_src)
            if progress:
                progress("working", n=n)


def fixed_scales(ck: Checkpoint, order: list[str], by_src: dict[str, Pairs]) -> dict[str, float]:
    """The per-tensor scales of the unit fixed before any of it is written (convert/fused.py): a fused group's shared
    one (w1 / w3 of an expert: the same unit, maybe not the same run of lone weights between stacks), a cut
    tensor's whole one."""
    return tensor_scales(((src, o.info, o.scheme, o.copy, any(p.piece.dim is not None for _, p in by_src[src]))
                          for src in order for o in (by_src[src][0][1],)), lambda src: _load(ck, by_src[src][0][1]))


def _write_each(ck: Checkpoint, order: list[str], by_src: dict[str, Pairs], progress, codes,
                fixed: dict[str, float]) -> None:
    """Source tensors `order`, one at a time: each read once (the next read ahead while this one is written), with
    the unit's `fixed` per-tensor scales."""
    with ThreadPoolExecutor(1) as reader:  # read-ahead of one source tensor: two in flight at most
        ahead = _read_ahead(reader, ck, by_src[order[0]][0][1]) if order else None
        for i, src in enumerate(order):
            x = ahead.result()
            ahead = _read_ahead(reader, ck, by_src[order[i + 1]][0][1]) if i + 1 < len(order) else None
            made: dict[tuple, list] = {}  # a replicated tensor is transformed once, not once per rank
            crcs: dict[tuple, int] = {}  # and passed over for its CRC-32 once: (made key, tensor) -> its CRC
            opts = replace(by_src[src][0][1].options, tensor_scale=fixed[src]) if src in fixed else None
            for writer, o in by_src[src]:
                try:
                    with counting() as tally:
                        if codes and o.src in codes:
                            produced = _encode(o, codes[o.src])
                        elif o.piece.dim is None:
                            key = (o.transform, o.scale_format, o.group_size, o.int4_scales, o.fp8_block)
                            if key not in made:
                                made[key] = list(_produce(o, x, opts))
                            for j, (name, tensor) in enumerate(made[key]):
                                crcs[key, j] = writer.write(name, tensor, crcs.get((key, j)))
                            produced = ()
                        else:
                            produced = _produce(o, _slice(ck, o, x), opts)
                        for name, tensor in produced:
                            writer.write(name, tensor)
                    if tally[0] or tally[1]:  # an exact cast counted its blocks
                        merged(writer.notes, cast_kind(o), tally)
                except KConvertError as e:
                    e.file = e.file or str(ck.logical[o.src].main.file)
                    raise
                if progress:  # in flight: the bar counts a file's bytes when it is durable (Run.wrote)
                    progress("working", n=o.bytes_in)
            del x, made, crcs


READ_AHEAD_BYTES = 1 << 20  # smaller source tensors are read when needed, on this thread


class _ReadLater:
    """A small tensor's read, done when its result is asked for: handing it to the reader thread would cost
    more than the read (a thread hand-off per tensor was most of shard's time at 100k+ small tensors)."""

    def __init__(self, ck: Checkpoint, o: Output):
        self.ck, self.o = ck, o

    def result(self):
        return _load(self.ck, self.o)


def _read_ahead(reader: ThreadPoolExecutor, ck: Checkpoint, o: Output):
    if ck.logical[o.src].stored_bytes < READ_AHEAD_BYTES:
        return _ReadLater(ck, o)
    return reader.submit(_load, ck, o)


def _load(ck: Checkpoint, o: Output):
    """The whole source tensor of `o`: dequantized/plain, or its stored parts for a lossless copy."""
    t = ck.logical[o.src]
    if o.copy is not None:
        return read_parts(t, o.copy.roles)
    return ck.read(o.src)


def _slice(ck: Checkpoint, o: Output, x):
    p = o.piece
    if p.dim is None:
        return x
    if o.copy is not None:  # the weight by the piece, its block scales by the blocks the piece covers
        b = o.copy.block
        w, s = x
        return (w.narrow(p.dim, p.start, p.stop - p.start).contiguous(),
                s.narrow(p.dim, p.start // b, -(-p.stop // b) - p.start // b).contiguous())
    piece = x.narrow(p.dim, p.start, p.stop - p.start)
    return piece if o.scheme is not None else piece.contiguous()  # quantizers read views


def _encode(o: Output, parts):
    """A calibrated weight's piece: its codes and group scales cut as the piece cuts the weight, encoded (the parts
    after them, nvfp4's weight_scale_2, are the whole tensor's)."""
    codes, scale, *rest = parts
    p = o.piece
    if p.dim == 0:
        codes, scale = codes[p.start:p.stop], scale[p.start:p.stop]
    elif p.dim == 1:
        g = codes.shape[1] // scale.shape[1]  # inputs per scale: int4's group, nvfp4's 16
        codes, scale = codes[:, p.start:p.stop], scale[:, p.start // g:p.stop // g]
    return zip((name for name, _, _ in o.specs()),
               o.scheme.encode(codes.contiguous(), scale.contiguous(), *rest, o.options))


def _produce(o: Output, x, opts: Options | None = None):
    specs = o.specs()
    return zip((name for name, _, _ in specs), stored_output(x, [tag for _, tag, _ in specs], o.copy, o.scheme,
                                                             opts or o.options, o.transform == "bf16", o.src))


def cast_kind(o: Output) -> str:
    """The kind an exact cast's counts are reported under: the tensor's component and its name's last part (its
    projection: routed_experts.w1)."""
    return f"{o.info.component}.{o.info.rule.pattern.removesuffix('.weight').rsplit('.', 1)[-1]}"