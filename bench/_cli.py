"""The shared ways bench scripts run commands (bench only): `cli` runs `kconvert` as a user does, a fresh process of
this tree's CLI; `measured` runs any command and reports its own CPU time and peak RSS."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# `python -c ENTRY ARGS` from a tree's root runs that tree's CLI through the console script's entry point
ENTRY = "import sys; from cli.main import entry; sys.argv[0] = 'kconvert'; entry()"

# Linux carries a process's peak RSS over fork and exec: a command started straight from a bench that holds
# 500 MB (torch, a fixture it built) reports at least 500 MB, whatever it used. Started from this small launcher
# instead, its peak is its own; the launcher reads the command's CPU and peak from wait4.
_LAUNCHER = """
import json, os, subprocess, sys
p = subprocess.Popen(sys.argv[2:])
_, status, use = os.wait4(p.pid, 0)
with open(sys.argv[1], "w") as f:
    json.dump({"cpu": use.ru_utime + use.ru_stime, "peak_rss": use.ru_maxrss * 1024}, f)
sys.exit(os.waitstatus_to_exitcode(status) & 255)
"""


def compiled(root: Path = ROOT) -> None:
    """Write the bytecode of a tree's packages, so the commands timed there import it rather than compile every
    module on every run (as they would where PYTHONDONTWRITEBYTECODE is set, or in a fresh worktree whose imports
    never wrote it, or after an edit): what a user's second run does."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", "kconvert", "cli", "engine"], cwd=root,
                   stdout=subprocess.DEVNULL, check=True)


def cli(*args, check: bool = False) -> subprocess.CompletedProcess:
    """`kconvert ARGS` from this tree, output captured; `check`: exit with its stderr when it fails."""
    r = subprocess.run([sys.executable, "-m", "cli.main", *map(str, args)], cwd=ROOT, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise SystemExit(f"kconvert {' '.join(map(str, args))} failed ({r.returncode}):\n{r.stderr}")
    return r


def measured(cmd: list, cwd: Path = ROOT, stdout=subprocess.PIPE) -> dict:
    """Run `cmd` (output captured unless `stdout` says otherwise): its exit code, stdout and stderr text, wall
    seconds (the launcher's own ~20 ms start included), and the command's own CPU seconds (all threads, its exit
    included) and peak RSS in bytes."""
    with tempfile.NamedTemporaryFile("r", suffix=".json") as report:
        t = time.perf_counter()
        proc = subprocess.run([sys.executable, "-S", "-c", _LAUNCHER, report.name, *map(str, cmd)], cwd=cwd, stdout=stdout,
                              stderr=subprocess.PIPE, text=True)
        wall = time.perf_counter() - t
        use = json.loads(report.read() or '{"cpu": 0, "peak_rss": 0}')  # empty: the launcher itself failed
    return {"returncode": proc.returncode, "stdout": proc.stdout or "", "stderr": proc.stderr, "wall": wall, **use}
