"""How long `kconvert` takes to answer before any work: `--help`, `--version`, a mistyped command and a
subcommand's `--help` (which reads the scheme registry, so imports torch), each a fresh interpreter,
side by side with `python -c pass` and `python -c "import torch"` on the same machine in the same run.

    .venv/bin/python bench/cli_bench.py --repeat 5
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from _cli import KCONVERT_CMD, ROOT

# each a fresh interpreter run from this tree's root; the kconvert ones are `python -m cli.main ...` (KCONVERT_CMD)
CASES = (
    ("python -c pass", [sys.executable, "-c", "pass"]),
    ("python -c 'import torch'", [sys.executable, "-c", "import torch"]),
    ("kconvert --help", [*KCONVERT_CMD, "--help"]),
    ("kconvert --version", [*KCONVERT_CMD, "--version"]),
    ("kconvert shrad (typo)", [*KCONVERT_CMD, "shrad"]),
    ("kconvert shard --help", [*KCONVERT_CMD, "shard", "--help"]),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5, help="Rounds (cases interleaved); the median is shown.")
    a = ap.parse_args()
    times: dict[str, list[float]] = {name: [] for name, _ in CASES}
    for _ in range(a.repeat):
        for name, cmd in CASES:
            t0 = time.perf_counter()
            subprocess.run(cmd, cwd=ROOT, capture_output=True)
            times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["python -c pass"])
    print(f"| command | median s ({a.repeat} rounds) | minus python start-up |")
    print("|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med:.2f} | {med - base:.2f} |")


if __name__ == "__main__":
    main()
