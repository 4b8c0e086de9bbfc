"""Random valid configs per family against their references (kconvert/fixtures/random_configs): each draw written
in the release's storage, converted at tp 1 without quantization, its float32 log-probs compared with the
reference's by verify's own path; mean KLD must stay below 1e-5. One draw replays by its seed:

    .venv/bin/python bench/random_configs.py --family dsv41 --seed 123           # one config, printed in full
    .venv/bin/python bench/random_configs.py --family dsv41 --seeds 0:100        # a sweep, one line per config
    .venv/bin/python bench/random_configs.py --seeds 0:100 --table               # every family, the results table

Each line: the family, the seed, the mean KLD against the reference (and a second reference where one applies);
a failure prints its replay command and its config. --table ends with one markdown row per family: configs run,
over the bound, errors, the largest mean KLD, draws the reference refused, seconds per config."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import _cli  # noqa: F401  (this tree first on sys.path)
from kconvert.fixtures.random_configs import FAMILY_NAMES, draw
from kconvert.fixtures.random_configs.run import BOUND, run


def _seeds(text: str) -> list[int]:
    lo, _, hi = text.partition(":")
    return list(range(int(lo), int(hi))) if hi else [int(lo)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", action="append", choices=FAMILY_NAMES, help="default: every family")
    ap.add_argument("--seed", type=int, help="one draw, its config printed and its files kept")
    ap.add_argument("--seeds", default="0:100", help="LO:HI, or one seed")
    ap.add_argument("--workdir", default="/tmp/kconvert-random-configs")
    ap.add_argument("--table", action="store_true", help="end with the markdown results table")
    ap.add_argument("--jsonl", help="append one JSON line per config to this file")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    seeds = [args.seed] if args.seed is not None else _seeds(args.seeds)
    rows, failed = [], 0
    for fam in args.family or FAMILY_NAMES:
        results, refused, t0 = [], 0, time.perf_counter()
        for seed in seeds:
            d = draw(fam, seed)
            refused += len(d.refused)
            if args.seed is not None:
                print(d.describe())
            r = run(d, Path(args.workdir) / fam / str(seed), keep=args.seed is not None)
            results.append(r)
            print(r.line(), flush=True)
            if not r.passed:
                failed += 1
                if args.seed is None:
                    print("  replay: " + d.describe().replace("\n", "\n  "), flush=True)
            if args.jsonl:
                with open(args.jsonl, "a") as f:
                    f.write(json.dumps({"family": fam, "seed": seed, "mean_kld": r.mean_kld, "second": r.second,
                                        "draft": r.draft, "error": r.error, "seconds": round(r.seconds, 2),
                                        "refused": len(d.refused)}) + "\n")
        klds = [k for r in results for k in r.klds]
        rows.append(f"| {fam} | {len(results)} | {sum(not r.passed and r.error is None for r in results)} | "
                    f"{sum(r.error is not None for r in results)} | {max(klds, default=float('nan')):.1e} | "
                    f"{refused} | {(time.perf_counter() - t0) / max(len(results), 1):.1f} |")
    if args.table:
        print(f"\n| family | configs | over {BOUND:g} | errors | largest mean KLD | draws refused by the reference "
              "| s / config |\n|---|---|---|---|---|---|---|")
        print("\n".join(rows))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
