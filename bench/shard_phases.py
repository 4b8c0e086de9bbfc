"""Where `shard`'s CPU time goes, phase by phase, in one process (bench only, not CI).

Runs `shard` on SRC with its unit pool replaced by a synchronous one (every phase on this thread, so CPU
time is attributed exactly) and prints CPU seconds of: opening the source (headers, canonical names,
folding), planning (validation included), writing the units (read, transform, write), committing them,
kconvert.json and the rank lists, the source's fingerprint, and the rest (journal, output checks), and of all of
them how much was folding the stored tensors into logical ones (0.00: never folded); writing the units also by
part (its stacks by size, opening and finishing the files, planning the stacks). Per written tensor the figures
say what metadata_bench.py's "beyond data" is made of. Copied into a worktree of an older commit (its
kconvert.json writer was shard._write_catalog), it times that tree the same way.

    .venv/bin/python bench/shard_phases.py /tmp/kmeta/topo-k25-L-E --quant fp8 --tp 8
"""

from __future__ import annotations

import argparse
import collections
import shutil
import tempfile
import time
from concurrent.futures import Future
from pathlib import Path

# a sibling script (bench/ is this script's folder), which imports bench/_cli.py first: this tree's kconvert first
# on sys.path
from metadata_bench import written_tensors


class SyncPool:
    """ThreadPoolExecutor's interface, running each task at submit."""

    def __init__(self, *a, **k):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False

    def submit(self, fn, *a, **k):
        f = Future()
        try:
            f.set_result(fn(*a, **k))
        except BaseException as e:  # noqa: BLE001  (handed to the waiter, as a pool does)
            f.set_exception(e)
        return f


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path)
    ap.add_argument("--quant", default="none")
    ap.add_argument("--tp", type=int, default=8)
    a = ap.parse_args(argv)
    import kconvert.convert.shard.job as sh
    from kconvert.convert.layout import Topology
    from kconvert.quant.policy import QuantPolicy
    from kconvert.source.checkpoint import Checkpoint

    import kconvert.convert.shard.unit as su

    cpu: collections.Counter = collections.Counter()
    units: collections.Counter = collections.Counter()  # parts of "write units" (not added to the phases)

    def timed(name, fn, into=cpu):
        def run(*args, **kw):
            t = time.process_time()
            try:
                return fn(*args, **kw)
            finally:
                into[name(*args) if callable(name) else name] += time.process_time() - t
        return run

    sh.ThreadPoolExecutor = SyncPool
    import kconvert.source.checkpoint as checkpoint_module

    folding: collections.Counter = collections.Counter()  # inside whichever phase asked first (0: never folded)
    checkpoint_module.fold = timed("folding into logical tensors", checkpoint_module.fold, folding)
    opener = Checkpoint.open.__func__
    Checkpoint.open = classmethod(lambda cls, *args, **kw: timed("open source", opener)(cls, *args, **kw))
    Checkpoint.fingerprint = timed("source fingerprint", Checkpoint.fingerprint)
    for fn, name in (("plan_items", "plan"), ("write_unit", "write units"), ("commit_all", "commit"),
                     ("write_catalog", "kconvert.json + rank lists")):
        fn = fn if hasattr(sh, fn) else f"_{fn}"  # (an older tree's private name)
        setattr(sh, fn, timed(name, getattr(sh, fn)))
    for fn, name in (("_open", "opening each unit's files"), ("plan_jobs", "stack planning"),
                     ("_finish", "finishing files (CRC, one write)"),
                     ("write_stack", lambda ck, srcs, by_src: "stacks of %s weights" % ("> 16" if len(srcs) > 16
                                                                                     else "1-16"))):
        setattr(su, fn, timed(name, getattr(su, fn), units))
    out = Path(tempfile.mkdtemp(prefix="shard-phases-"))
    try:
        t = time.process_time()
        sh.shard(sh.ShardJob(str(a.src), str(out / "out"), topology=Topology(tp=a.tp), quant=QuantPolicy(a.quant),
                             workers=1))
        total = time.process_time() - t
        written = written_tensors(out / "out")
    finally:
        shutil.rmtree(out, ignore_errors=True)
    cpu["rest (journal, checks)"] = total - sum(cpu.values())
    print(f"shard --tp {a.tp} --quant {a.quant}: {total:.2f} s CPU, {written} tensors written")
    for name, s in cpu.items():
        print(f"  {name:36s} {s:6.2f} s  {1e6 * s / written:6.1f} us/tensor")
        if name == "write units":
            for part, s in sorted(units.items(), key=lambda kv: -kv[1]):  # (their data included)
                print(f"    {part:34s} {s:6.2f} s")
    print(f"  of which {'folding into logical tensors':27s} {folding['folding into logical tensors']:6.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
