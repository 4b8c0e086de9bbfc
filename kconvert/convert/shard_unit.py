"""One unit of `kconvert shard` (a layer, globals or vision), every rank's file of it in one pass over
the source: each source tensor is read once (a reader thread fetches the next while the current one is
sliced, quantized and written: two in flight at most), and each rank's slice goes to that rank's file.
`write_unit` leaves the files finished but not yet durable (the caller commits a unit's files together,
off the worker: safetensors_write.commit_all); `run_unit` also commits them (and compresses them)."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from kconvert.errors import KConvertError
from kconvert.io.safetensors_write import SafetensorsWriter, WrittenFile, commit_all
from kconvert.source.checkpoint import Checkpoint
from kconvert.source.formats import read_checked
from kconvert.convert.quant_policy import FP8_BLOCK
from kconvert.convert.quantize import quantize_fp8_block, quantize_int4_group, quantize_int8_channel
from kconvert.convert.shard_plan import Output, WorkItem


def run_unit(ck: Checkpoint, batch: list[WorkItem], out: Path, progress,
             level: int | None = None) -> list[tuple[WrittenFile, dict | None]]:
    """write_unit, then commit the unit's files. With a zstd `level`, each committed file is then
    compressed in place (temp + fsync + rename) before the caller journals it."""
    written = commit_all(write_unit(ck, batch, out, progress))
    if level is None:
        return [(rec, None) for rec in written]
    from kconvert.io.compress_file import compress_file

    return [(rec, compress_file(rec.path, rec.path, level=level, threads=min(8, os.cpu_count() or 1),
                                expect_crc32=rec.crc32).record()) for rec in written]


def write_unit(ck: Checkpoint, batch: list[WorkItem], out: Path, progress) -> list[SafetensorsWriter]:
    """Write every rank's file of one unit (a layer, globals or vision) in one pass over the source:
    each source tensor is read once, and each rank's slice of it goes to that rank's file. Memory:
    the tensor being written plus the one read ahead. Returns the finished writers (bytes written,
    writeback started, not yet durable: commit_all them before journalling)."""
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
                made: dict[tuple, list] = {}  # a replicated tensor is transformed once, not once per rank
                for writer, o in by_src[src]:
                    try:
                        if o.piece.dim is None:
                            key = (o.transform, o.scale_format, o.group_size, o.int4_scales)
                            if key not in made:
                                made[key] = list(_produce(o, x))
                            produced = made[key]
                        else:
                            produced = _produce(o, _slice(ck, o, x))
                        for name, tensor in produced:
                            writer.write(name, tensor)
                    except KConvertError as e:
                        e.file = e.file or str(ck.logical[o.src].main.file)
                        raise
                    if progress:
                        progress("advance", n=o.bytes_in)
                del x, made
        for wr in writers:
            wr.finish()
    except BaseException:
        for wr in writers:
            wr.abort()
        raise
    return writers


def _load(ck: Checkpoint, o: Output):
    """The whole source tensor of `o`: dequantized/plain, or (fp8 weight, scale) for lossless copies."""
    t = ck.logical[o.src]
    if o.transform == "fp8_copy":
        return read_checked(t.parts["weight"]), read_checked(t.parts["scale"])
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
    piece = x.narrow(p.dim, p.start, p.stop - p.start)
    return piece if o.transform in ("fp8", "int8", "int4") else piece.contiguous()  # quantizers read views


def _produce(o: Output, x):
    if o.transform == "fp8_copy":
        yield o.src, x[0]
        yield o.src + "_scale_inv", x[1].to(torch.float32)
        return
    if o.transform in ("fp8", "int8", "int4"):  # each refuses NaN/Inf (found from its scales)
        if o.transform == "int4":
            q, s = quantize_int4_group(x, o.group_size, o.int4_scales, o.src)
            yield o.src + "_packed", q
            yield o.src + "_scale", s
        elif o.transform == "fp8":
            q, s = quantize_fp8_block(x, FP8_BLOCK, o.scale_format, o.src)
            yield o.src, q
            yield o.src + "_scale_inv", s
        else:
            q, s = quantize_int8_channel(x, o.src)
            yield o.src, q
            yield o.src + "_scale", s
        return
    yield o.src, (x.to(torch.bfloat16) if o.transform == "bf16" else x).contiguous()
