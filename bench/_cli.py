"""What the bench scripts share (bench only). Importing it puts this tree first on sys.path, so a script imports it
before kconvert, engine or cli. `cli` runs `kconvert` as a user does (a fresh process of this tree's CLI:
`KCONVERT_CMD`), `in_process` in this process; `measured` runs any command and reports its own CPU time and peak
RSS; `timed_shard` times one `shard`; `fixture` and `conversion` build a bench's inputs into its work folder once."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# This tree's kconvert, engine and cli, not whichever ones the venv installed (a bench may compare two trees): first
# on sys.path, before a script imports any of them. Scripts run as `python bench/X.py`, so bench/ is on sys.path
# and `from _cli import ...` works as their first import.
sys.path.insert(0, str(ROOT))

# `KCONVERT_CMD ARGS` with cwd=ROOT: this tree's CLI in a fresh process (`python -m cli.main`)
KCONVERT_CMD = [sys.executable, "-m", "cli.main"]
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
    r = subprocess.run([*KCONVERT_CMD, *map(str, args)], cwd=ROOT, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise SystemExit(f"kconvert {' '.join(map(str, args))} failed ({r.returncode}):\n{r.stderr}")
    return r


def in_process(*args) -> subprocess.CompletedProcess:
    """`kconvert ARGS` in this process, through cli.main.main (what turns errors into an exit code and a message),
    its stdout and stderr captured: for a bench that runs hundreds of commands to compare what they produce, not
    how long they take to start."""
    from cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main([*map(str, args)])
    return subprocess.CompletedProcess(["kconvert", *map(str, args)], code, out.getvalue(), err.getvalue())


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


def timed_shard(src: Path, out: Path, *args) -> dict:
    """`kconvert shard SRC OUT ARGS --json` into a fresh `out`, in its own process as a user runs it: its JSON
    report plus "wall", the seconds the command took from outside (start-up included). Exits when it fails."""
    shutil.rmtree(out, ignore_errors=True)
    t = time.perf_counter()
    r = cli("shard", src, out, *args, "--json", check=True)
    return {**json.loads(r.stdout), "wall": time.perf_counter() - t}


def fixture(preset: str, path: Path, **kwargs) -> Path:
    """`preset` built into `path` (build_fixture's keywords: size, seed, layers ...) unless it is there already:
    benches keep their inputs in a work folder between runs. build_fixture writes into a temporary folder and
    renames it into place at the end, so a config.json at `path` (every preset writes one) means a complete
    checkpoint; anything else there (an older, in-place build cut short) is removed and built again."""
    path = Path(path)
    if (path / "config.json").exists():
        return path
    shutil.rmtree(path, ignore_errors=True)
    from kconvert.fixtures import build_fixture
    from kconvert.fixtures.presets import TRAINED_PRESETS

    if preset in TRAINED_PRESETS and set(kwargs) <= {"seed"}:  # trained by `kconvert fixture`, whose process pins the
        # AVX2 kernels before torch is imported (kconvert/fixtures/kernels.py): the bytes the tests and docs know
        cli("fixture", preset, path, "--seed", kwargs.get("seed", 0), check=True)
        return path
    return build_fixture(preset, path, **kwargs)


def conversion(src: Path, out: Path, tp: int = 1, quant: str = "none", **options) -> Path:
    """`src` sharded into `out` in this process (`--tp`, `--quant` and ShardJob's other options) unless that conversion
    is there already: shard writes kconvert.json last, so its presence means complete (without it, shard resumes)."""
    out = Path(out)
    if not (out / "kconvert.json").exists():
        from kconvert.convert.layout import Topology
        from kconvert.convert.shard.job import ShardJob, shard
        from kconvert.quant.policy import QuantPolicy

        shard(ShardJob(str(src), str(out), topology=Topology(tp=tp), quant=QuantPolicy(quant), **options))
    return out
