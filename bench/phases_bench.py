"""Where `shard` and `load` spend their time, phase by phase, beside `cp -r` + `sync` and safetensors' `load_file`
(bench only, not CI; issue 57).

Each conversion runs in this process with DEFAULT options (workers, stacks, read-ahead) and the functions that do
each phase wrapped by a timer: the seconds a thread spends in a phase, its nested phases' taken out, summed over
the threads (so a phase can exceed the wall time when workers overlap; "wait" is the journalling thread blocked
on the next unit). Phases: read (mapping or reading the source bytes; first touches of a mapping fault in where
they happen, usually in "check"), check (the NaN/Inf test of every source tensor), decode (dequantizing a stored
form), slice, quantize (a scheme's encode, or its lossless copy's re-encoding), CRC (each tensor's CRC-32 and the
file's), write (copying into staged files, positioned writes), fsync (files, directories, the journal), wait; and
then the wall time with a final `sync`. The yardsticks run on the same files once each between the conversions:
`cp -r SRC` + `sync` and `cp -r` of shard's output + `sync` (the same bytes); for the load, in this process,
safetensors' `load_file` of the rank's files, every tensor touched (one byte a page), and a raw read of the same
files (`cat > /dev/null`, page cache warm). With --pairs N (default 3), whole processes too: `kconvert shard` +
`sync` (start-up included), `cp -r` of the source + `sync` and of shard's output + `sync`, interleaved N times,
medians: the ratio a user sees.

Sources (built once into --work): `scale` bf16 of --size; its block-FP8 twin (`kconvert export --format
fp8-block` of it: the same weights as DeepSeek's FP8 blocks); and for the FP4 rows DeepSeek-V4 in V4-Flash's
storage (FP8 + MXFP4 experts, transformers' model class at the bench widths below, about --size / 8 on disk).

    .venv/bin/python bench/phases_bench.py --size 3GB --work /tmp/kphases --json /tmp/kphases/phases.json
    .venv/bin/python bench/phases_bench.py --size 300MB --only none,load --pairs 0      # a quick look

Over 300 lines: every conversion kind's phase timers, the yardsticks (cp -r + sync, load_file, a raw read)
and the table are one measurement; they are read together.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import threading
import time
import zlib
from contextlib import contextmanager
from pathlib import Path

from _cli import fixture  # first: this tree's kconvert on sys.path

CASES = ("none", "fp8", "fp8-blocks", "mxfp4-fp8", "fp4", "mxfp4-nvfp4", "mxfp4-none", "load")
PHASES = ("read", "check", "decode", "slice", "quantize", "CRC", "write", "fsync", "wait")


class Phases:
    """Exclusive seconds per phase, summed over threads: a thread's time in a phase stops while it is in a nested
    one (a read inside a dequantize counts as read, not decode)."""

    def __init__(self):
        self.seconds: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()
        self._local = threading.local()
        self._lock = threading.Lock()
        self._undo: list = []

    def timed(self, phase: str, fn):
        def run(*a, **k):
            stack = self._local.__dict__.setdefault("stack", [])
            now = time.perf_counter()
            if stack:  # the enclosing phase pauses
                outer, since = stack[-1]
                self._add(outer, now - since)
            stack.append([phase, now])
            try:
                return fn(*a, **k)
            finally:
                end = time.perf_counter()
                _, since = stack.pop()
                self._add(phase, end - since, 1)
                if stack:
                    stack[-1][1] = end

        run.__wrapped__ = fn
        return run

    def _add(self, phase: str, s: float, calls: int = 0) -> None:
        with self._lock:
            self.seconds[phase] += s
            self.calls[phase] += calls

    def wrap(self, owner, attr: str, phase: str) -> None:
        old = getattr(owner, attr)
        self._undo.append((owner, attr, old))
        setattr(owner, attr, self.timed(phase, old))

    def undo(self) -> None:
        for owner, attr, old in reversed(self._undo):
            setattr(owner, attr, old)
        self._undo.clear()


class _Zlib:
    """zlib with crc32 timed (the writer's module global), everything else zlib's own."""

    def __init__(self, crc32):
        self.crc32 = crc32

    def __getattr__(self, name):
        return getattr(zlib, name)


@contextmanager
def instrumented():
    """Every phase's functions wrapped for the duration (modules as `shard` and the loader import them)."""
    import kconvert.convert.shard.byte_copy as byte_copy
    import kconvert.convert.shard.job as job
    import kconvert.convert.shard.stacks as stacks
    import kconvert.convert.shard.unit as unit
    import kconvert.disk_format.journal as journal
    import kconvert.io.safetensors_read as st_read
    import kconvert.io.safetensors_write as st_write
    import kconvert.io.stacked_read as stacked_read
    import kconvert.io.window as window
    import kconvert.load.loader as loader
    import kconvert.quant.stacked as qstacked
    import kconvert.source.formats as formats
    import kconvert.source.stacked as src_stacked

    p = Phases()
    for owner, attr, phase in (
            (st_read, "read_entry_bytes", "read"), (stacked_read, "read_stacked", "read"),
            (formats, "all_finite", "check"), (src_stacked, "all_finite", "check"),
            (src_stacked, "scale_overflow", "check"),
            (formats, "_dequantize", "decode"), (src_stacked, "dequantize_fp4", "decode"),
            (src_stacked, "dequantize_int4_words", "decode"),
            (unit, "_slice", "slice"),
            (unit, "_produce", "quantize"), (stacks, "_produce", "quantize"), (stacks, "_even_split", "quantize"),
            (qstacked, "copy_parts", "quantize"),
            (st_write, "crc32_combine", "CRC"),
            (st_write.SafetensorsWriter, "_write", "write"), (st_write.SafetensorsWriter, "_pwrite", "write"),
            (st_write.SafetensorsWriter, "_sync", "fsync"), (st_write, "fsync_dir", "fsync"),
            (journal.JournalLog, "add_all", "fsync"),
            (window, "_take", "wait"),
            (loader, "_map_file", "read"), (loader, "tensor_views", "views"),
            (byte_copy, "read_entry_bytes", "read"), (byte_copy, "require_finite_bytes", "check"),
            (byte_copy, "_cut", "slice")):
        p.wrap(owner, attr, phase)
    p.wrap(src_stacked, "read_stacked", "read")  # (imported by name there: wrapped where it is called from)
    for owner in (st_write, loader):  # their CRC-32 (zlib's module global in an older tree)
        if hasattr(owner, "crc32"):
            p.wrap(owner, "crc32", "CRC")
        else:
            p._undo.append((owner, "zlib", owner.zlib))
            owner.zlib = _Zlib(p.timed("CRC", zlib.crc32))
    del job
    try:
        yield p
    finally:
        p.undo()


def wall(cmd: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t


def cp_sync(src: Path, work: Path) -> float:
    """`cp -r SRC` + `sync`, seconds (the copy removed after, outside the time; SRC's page cache warmed first)."""
    src, dst = src.resolve(), work / "cp-copy"
    if dst.is_symlink():
        dst.unlink()
    shutil.rmtree(dst, ignore_errors=True)
    subprocess.run(["sh", "-c", f"find '{src}' -type f -exec cat {{}} + > /dev/null; sync"], check=True)
    s = wall(["sh", "-c", f"cp -r '{src}' '{dst}' && sync"])
    shutil.rmtree(dst, ignore_errors=True)
    return s


def cli_pairs(src: Path, work: Path, tp: int, quant: str, pairs: int) -> dict:
    """Whole processes, interleaved `pairs` times: `kconvert shard SRC OUT --tp --quant` + `sync` (start-up
    included: what a user waits for), `cp -r SRC` + `sync`, and `cp -r` of shard's output + `sync` (the same bytes
    shard writes). Medians, with each run and the load average before it."""
    import statistics

    from _cli import KCONVERT_CMD, ROOT

    out, kept, runs = work / "cli-out", work / "cli-kept", {"shard": [], "cp source": [], "cp same bytes": []}
    shutil.rmtree(kept, ignore_errors=True)
    shard = " ".join(map(str, [*KCONVERT_CMD, "shard", src, out, "--tp", tp, "--quant", quant]))
    for i in range(pairs + 1):  # the first round warms the caches and makes the copy of shard's output: not counted
        for name, cmd in (("shard", f"rm -rf '{out}' && cd '{ROOT}' && {shard} > /dev/null && sync"),
                          ("cp source", f"rm -rf '{work}/cp-copy' && cp -r '{src.resolve()}' '{work}/cp-copy' && sync"),
                          ("cp same bytes", f"rm -rf '{work}/cp-copy' && cp -r '{kept}' '{work}/cp-copy' && sync")):
            if name == "cp same bytes" and not kept.exists():
                shutil.copytree(out, kept)
            load = os.getloadavg()[0]
            s = wall(["sh", "-c", cmd])
            if i:
                runs[name].append((round(s, 2), round(load, 1)))
    for d in (out, kept, work / "cp-copy"):
        shutil.rmtree(d, ignore_errors=True)
    med = {k: statistics.median(s for s, _ in v) for k, v in runs.items()}
    return {"runs": runs, "median": med, "x cp source": med["cp source"] / med["shard"],
            "x cp same bytes": med["cp same bytes"] / med["shard"]}


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def shard_case(src: Path, out: Path, tp: int, quant: str) -> dict:
    """One default `shard` in this process, instrumented, + `sync`: wall seconds, CPU seconds and the phases."""
    from kconvert.convert.layout import Topology
    from kconvert.convert.shard.job import ShardJob, shard
    from kconvert.quant.policy import QuantPolicy

    import torch  # noqa: F401 (imported before the clock starts: a quantizing job's first unit would import it)

    shutil.rmtree(out, ignore_errors=True)
    subprocess.run(["sync"], check=True)
    with instrumented() as p:
        t, c = time.perf_counter(), time.process_time()
        shard(ShardJob(str(src), str(out), topology=Topology(tp=tp), quant=QuantPolicy(quant)))
        run_s = time.perf_counter() - t
        subprocess.run(["sync"], check=True)
        wall_s, cpu_s = time.perf_counter() - t, time.process_time() - c
    return {"wall": wall_s, "run": run_s, "cpu": cpu_s, "bytes_out": dir_bytes(out), "bytes_in": dir_bytes(src),
            "phases": dict(p.seconds)}


def touch_pages(tensors) -> int:
    """One byte of every page of every tensor read (what a consumer of all the weights does at least)."""
    import torch

    total = 0
    for t in tensors:
        if t.numel():
            b = t.reshape(-1).view(torch.uint8)
            total += int(b[::4096].sum())
    return total


def load_case(conv: Path, rank: int, repeat: int) -> dict:
    """`load --rank` on CPU (kconvert.load.loader.stream, zero-copy) with verification off and on, beside
    safetensors' load_file of the same files and a raw read; every tensor touched; best of `repeat`."""
    from safetensors.torch import load_file

    from kconvert.load.loader import open_converted

    conv_ = open_converted(conv, rank=rank)
    files = [conv_.file_of(u) for u in conv_.units]
    nbytes = sum(f.stat().st_size for f in files)
    subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)  # page cache warm

    def kconvert_load(verify):
        c = open_converted(conv, rank=rank)
        for _, tensors in c.stream("cpu", verify=verify):
            touch_pages(tensors.values())

    def st_load():
        for f in files:
            touch_pages(load_file(f).values())

    def raw_read():
        subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)

    res = {"bytes": nbytes, "files": len(files)}
    for name, fn in (("load_file", st_load), ("kconvert", lambda: kconvert_load(False)),
                     ("kconvert verify", lambda: kconvert_load(True)), ("cat", raw_read)):
        best, phases = None, None
        for _ in range(repeat):
            with instrumented() as p:
                t = time.perf_counter()
                fn()
                s = time.perf_counter() - t
            if best is None or s < best:
                best, phases = s, dict(p.seconds)
        res[name] = {"s": best, "phases": phases}
    return res


def fp8_blocks_source(src: Path, work: Path) -> Path:
    """The scale checkpoint as DeepSeek's block FP8 (`export --format fp8-block`), built once."""
    out = work / f"{src.name}-fp8-blocks"
    if not (out / "config.json").exists() or not any(out.glob("*.index.json")):
        from _cli import in_process

        r = in_process("export", src, out, "--format", "fp8-block", "--overwrite")
        if r.returncode:
            raise SystemExit(r.stderr)
    return out


V4_WIDTHS = {"hidden_size": 1024, "moe_intermediate_size": 1024, "num_attention_heads": 8, "index_n_heads": 8,
             "head_dim": 128, "q_lora_rank": 512, "o_groups": 8, "o_lora_rank": 128}  # (cut 8 ways: tp 8)


def mxfp4_source(work: Path, size: int) -> Path:
    """DeepSeek-V4 in V4-Flash's storage (FP8 linears + MXFP4 routed experts) of about `size` bytes on disk, nearly
    all MXFP4 experts (as Kimi K3 and V4 are): its experts' count sets the size. Built once."""
    out = work / f"v4-flash-{size // 10**6}MB-mxfp4"
    if (out / "config.json").exists():
        return out
    from kconvert.fixtures.models.dsv4 import build_v4_model, write_v4_model

    per_expert = 3 * V4_WIDTHS["hidden_size"] * V4_WIDTHS["moe_intermediate_size"] * 17 // 32  # MXFP4: 4.25 bits
    layers = 5  # tiny-dsv4's schedule: 4 MoE layers and the MTP block's
    experts = max(8, min(1024, size // (per_expert * layers) // 8 * 8))
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    write_v4_model(build_v4_model(0, {**V4_WIDTHS, "n_routed_experts": experts}), out, 0, "flash")
    return out


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


def print_shard(label: str, r: dict) -> None:
    ph, cp, cp_out = r["phases"], r["cp_sync"], r["cp_sync_out"]
    print(f"\n{label}: {r['bytes_in'] / 1e9:.2f} GB in, {r['bytes_out'] / 1e9:.2f} GB out; in this process "
          f"{r['wall']:.2f} s with sync (run {r['run']:.2f} s), {r['cpu']:.2f} CPU s; cp -r + sync of the source "
          f"{cp:.2f} s, of shard's output (the same bytes) {cp_out:.2f} s: shard at {ratio(cp, r['wall'])} of the "
          f"source's copy, {ratio(cp_out, r['wall'])} of the same bytes' ({r['bytes_in'] / r['wall'] / 1e9:.2f} GB/s "
          "of source)")
    print("  | phase | thread s | of wall |\n  |---|---|---|")
    for k in PHASES:
        if ph.get(k):
            print(f"  | {k} | {ph[k]:.2f} | {ph[k] / r['wall']:.0%} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="3GB", help="bf16 source size (the scale preset)")
    ap.add_argument("--work", default="/tmp/kphases")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--only", default=",".join(CASES), help=f"of {','.join(CASES)}")
    ap.add_argument("--rank", type=int, default=0, help="the rank `load` streams")
    ap.add_argument("--repeat", type=int, default=3, help="load: best of N")
    ap.add_argument("--pairs", type=int, default=3, help="whole-process runs of each shard beside cp -r + sync "
                    "(interleaved; 0: none)")
    ap.add_argument("--json", type=Path, help="also write every figure here")
    a = ap.parse_args(argv)
    from cli.units import parse_size

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    size = parse_size(a.size)
    only = a.only.split(",")
    src = fixture("scale", work / f"scale-{a.size}", size=size)
    print(f"load average {os.getloadavg()[0]:.2f} at start; source {src} ({dir_bytes(src) / 1e9:.2f} GB)")
    report: dict = {"load_average_start": os.getloadavg()[0]}
    rows = [("none", src, "none"), ("fp8", src, "fp8")]
    if "fp8-blocks" in only:
        rows.append(("fp8-blocks", fp8_blocks_source(src, work), "fp8"))
    if {"mxfp4-fp8", "fp4", "mxfp4-nvfp4", "mxfp4-none"} & set(only):
        v4 = mxfp4_source(work, size // 8)  # (building it holds its bf16 model: 4x this in memory)
        rows += [("mxfp4-fp8", v4, "fp8"), ("fp4", v4, "fp4"), ("mxfp4-nvfp4", v4, "nvfp4"), ("mxfp4-none", v4, "none")]
    for label, s, quant in rows:
        if label not in only:
            continue
        subprocess.run(["cat", *map(str, s.glob("*.safetensors"))], stdout=subprocess.DEVNULL, check=True)
        r = shard_case(s, work / "out", a.tp, quant)
        r["cp_sync"] = cp_sync(s, work)  # the source's bytes
        r["cp_sync_out"] = cp_sync(work / "out", work)  # the bytes shard wrote (tp 8 replicates some tensors)
        r["load_average"] = os.getloadavg()[0]
        report[label] = r
        print_shard(f"shard --tp {a.tp} --quant {quant} ({label}, load avg {r['load_average']:.2f})", r)
        if a.pairs:
            c = r["cli"] = cli_pairs(s, work, a.tp, quant, a.pairs)
            print(f"  whole process, medians of {a.pairs} interleaved: shard + sync {c['median']['shard']:.2f} s, cp -r "
                  f"+ sync of the source {c['median']['cp source']:.2f} s ({c['x cp source']:.2f}x), of shard's "
                  f"output {c['median']['cp same bytes']:.2f} s ({c['x cp same bytes']:.2f}x); runs (s, load avg): "
                  + "; ".join(f"{k} {v}" for k, v in c["runs"].items()))
    if "load" in only:
        conv = work / f"scale-{a.size}-tp{a.tp}-none"
        if not (conv / "kconvert.json").exists():
            from _cli import conversion

            conversion(src, conv, tp=a.tp, quant="none")
        r = load_case(conv, a.rank, a.repeat)
        r["load_average"] = os.getloadavg()[0]
        report["load"] = r
        st = r["load_file"]["s"]
        print(f"\nload --rank {a.rank} on cpu ({r['files']} files, {r['bytes'] / 1e9:.2f} GB, page cache warm, every "
              f"tensor touched, best of {a.repeat}; load avg {r['load_average']:.2f}):")
        print("  | contender | s | GB/s | x load_file | x cat | phases (thread s) |\n  |---|---|---|---|---|---|")
        for name in ("load_file", "kconvert", "kconvert verify", "cat"):
            s = r[name]["s"]
            ph = ", ".join(f"{k} {v:.3f}" for k, v in sorted(r[name]["phases"].items()) if v > 0.0005)
            print(f"  | {name} | {s:.3f} | {r['bytes'] / s / 1e9:.2f} | {ratio(st, s)} | {ratio(r['cat']['s'], s)} "
                  f"| {ph or '-'} |")
    shutil.rmtree(work / "out", ignore_errors=True)
    if a.json:
        a.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
