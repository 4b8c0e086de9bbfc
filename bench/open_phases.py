"""Where opening, validating and summarising a checkpoint spends its CPU, phase by phase (bench only, not CI).

In one process, with the cycle collector paused as `inspect` runs: the bare `json.loads` of every header
(the floor), then Checkpoint.open's phases (index, headers, merge with the index check, family binding,
canonical names), validation (stored_groups' columns) and inspect's summary; then the fold into logical tensors
that shard, export and verify add. Best of --rounds, so a
busy 2-core machine's slow rounds drop out; the "what remains" figures in docs/BENCHMARKS.md come from it.

    .venv/bin/python bench/open_phases.py /tmp/kmeta/topo-k25-L-E
"""

from __future__ import annotations

import argparse
import json
import struct
import time
from pathlib import Path

import _cli  # first: importing it puts this tree's kconvert first on sys.path, all this script needs of it

del _cli


def one_round(root: Path) -> dict[str, float]:
    import kconvert.source.checkpoint as C
    from kconvert.inspect.checkpoint import summarize
    from kconvert.source.logical import fold

    t: dict[str, float] = {}

    def timed(label, fn):
        start = time.process_time()
        out = fn()
        t[label] = time.process_time() - start
        return out

    raws = []
    for f in sorted(root.glob("*.safetensors")):
        with open(f, "rb") as fh:
            raws.append(fh.read(struct.unpack("<Q", fh.read(8))[0]))
    timed("json.loads of the headers (floor)", lambda: [json.loads(r) for r in raws])
    config = C.read_config(root)
    index = timed("index (read, parse, path checks)", lambda: C.index_map_of(root))
    files, agreed = timed("headers + index agreement", lambda: C.read_headers(root, C.shard_files(root, index), index))
    stored = timed("merge", lambda: C.merged(root, files, agreed))
    model = timed("bind the family manifest", lambda: C.bind(config, config_file=str(root / "config.json")))
    stored = timed("canonical names", lambda: C._canonical(model, stored) if model.aliases else stored)
    ck = C.Checkpoint.__new__(C.Checkpoint)  # the parts above, assembled as Checkpoint.__init__ would
    ck.root, ck.config, ck.files, ck.stored, ck.source, ck.remote = root, config, files, stored, str(root), False
    ck.model, ck._logical, ck._info, ck._grouped, ck._infos_filled = model, None, {}, None, False
    timed("validate (buckets)", ck.validate)
    timed("inspect's summary", lambda: summarize(ck))
    timed(FOLD, lambda: fold(stored))  # what shard / export / verify add: not part of inspect and plan
    return t


FOLD = "fold into logical tensors (not inspect)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    from kconvert.io.gc_pause import paused_gc

    best: dict[str, float] = {}
    for _ in range(a.rounds):
        with paused_gc():
            for label, s in one_round(a.src).items():
                best[label] = min(best.get(label, s), s)
    floor = best["json.loads of the headers (floor)"]
    for label, s in best.items():
        print(f"  {label:42s} {s:6.3f} s  {s / floor:5.2f}x the floor")
    print(f"  {'open + validate + summary':42s} {sum(best.values()) - floor - best[FOLD]:6.3f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
