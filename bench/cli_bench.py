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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = (
    ("python -c pass", ["-c", "pass"]),
    ("python -c 'import torch'", ["-c", "import torch"]),
    ("kconvert --help", ["-m", "cli.main", "--help"]),
    ("kconvert --version", ["-m", "cli.main", "--version"]),
    ("kconvert shrad (typo)", ["-m", "cli.main", "shrad"]),
    ("kconvert shard --help", ["-m", "cli.main", "shard", "--help"]),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5, help="Rounds (cases interleaved); the median is shown.")
    a = ap.parse_args()
    times: dict[str, list[float]] = {name: [] for name, _ in CASES}
    for _ in range(a.repeat):
        for name, args in CASES:
            t0 = time.perf_counter()
            subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True)
            times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["python -c pass"])
    print(f"| command | median s ({a.repeat} rounds) | minus python start-up |")
    print("|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med:.2f} | {med - base:.2f} |")


if __name__ == "__main__":
    main()
