"""The shared way bench scripts run `kconvert` as a user does: a fresh process of this tree's CLI (bench only)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cli(*args, check: bool = False) -> subprocess.CompletedProcess:
    """`kconvert ARGS` from this tree, output captured; `check`: exit with its stderr when it fails."""
    r = subprocess.run([sys.executable, "-m", "cli.main", *map(str, args)], cwd=ROOT, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise SystemExit(f"kconvert {' '.join(map(str, args))} failed ({r.returncode}):\n{r.stderr}")
    return r
