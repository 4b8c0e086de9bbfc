"""Small helpers shared by tests: run the CLI as a user would, read safetensors independently."""

from __future__ import annotations

import contextlib
import json
import struct
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str, check: bool = False, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """`kconvert ARGS` in a subprocess (exactly what a user gets: exit code, stdout, stderr)."""
    import os

    proc = subprocess.run([sys.executable, "-m", "cli.main", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})
    if check and proc.returncode != 0:
        raise AssertionError(f"kconvert {' '.join(map(str, args))} failed ({proc.returncode}):\n{proc.stderr}")
    return proc


def cli_here(*args: str) -> subprocess.CompletedProcess:
    """`kconvert ARGS` through the CLI's own entry point (cli.main.main: the one place that turns errors into
    exit codes and one-line messages) inside this process: no interpreter start or torch import per call,
    and the session's in-process caches (the trained fixture's training) apply. For commands that fail
    fast on bad input or reuse a cache; `run_cli` stays the way to test what a separate process does."""
    import io

    from cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return subprocess.CompletedProcess(["kconvert", *map(str, args)], code, out.getvalue(), err.getvalue())


@contextlib.contextmanager
def one_thread():
    """Torch on one thread while an engine or a reference runs in this process, as each spawned rank of a
    2-core machine runs (kconvert.verify.run.spawn_main): no OpenMP threads spin-waiting on a loaded machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def verify_json(out, ref, *extra) -> tuple[subprocess.CompletedProcess, dict | None]:
    """`kconvert verify OUT --reference REF --json EXTRA...` in this process on one torch thread: (the run, its
    report, or None when it printed none)."""
    import json

    with one_thread():
        r = cli_here("verify", out, "--reference", ref, "--json", *extra)
    return r, json.loads(r.stdout) if r.stdout.strip() else None


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])


def load_source(root: Path) -> dict[str, torch.Tensor]:
    """Every stored tensor of an HF-style checkpoint, read with the safetensors library (not ours)."""
    index = json.loads((root / "model.safetensors.index.json").read_text())
    out: dict[str, torch.Tensor] = {}
    for f in sorted(set(index["weight_map"].values())):
        out.update(load_file(root / f))
    return out


def header_offsets(path: Path) -> tuple[int, dict]:
    """(data start, header dict) of a safetensors file, parsed here independently."""
    raw = path.read_bytes()[:8]
    (n,) = struct.unpack("<Q", raw)
    header = json.loads(path.read_bytes()[8:8 + n])
    return 8 + n, header


def read_meta(out: Path) -> dict:
    """OUT/kconvert.json with every rank's tensor list inline (format version 4 keeps them per rank)."""
    from kconvert.disk_format.catalog import Catalog

    return Catalog.read(out).whole_doc()


def rewrite_catalog(out: Path, meta: dict) -> None:
    """Write `meta` as OUT/kconvert.json with a fresh digest: a consistent-looking document, as a tool
    that knows the format (or a careful attacker) would leave it. Checks then have to catch the damage
    elsewhere; a plain edit without the digest is refused on open (tests/disk_format/test_catalog.py). A `tensors` list
    (from read_meta) goes back into the per-rank lists, with fresh sha256s."""
    from kconvert.disk_format.catalog import SPLIT_VERSION, digest_of
    from kconvert.disk_format.rank_tensors import write_lists

    meta = dict(meta)
    if "tensors" in meta and meta.get("format_version", 0) >= SPLIT_VERSION:
        meta["tensors_by_rank"] = write_lists(Path(out), meta.pop("tensors"), len(meta["tensors_by_rank"]))
    meta["digest"] = digest_of(meta)
    (Path(out) / "kconvert.json").write_text(json.dumps(meta, indent=1))


def shard_job(src, out, *, tp: int = 1, ep: int | None = None, pp: int = 1, pp_layers: str | None = None,
              quant: str = "none", **options):
    """A ShardJob from the flat options tests name (--tp, --ep, --pp, --pp-layers, --quant and its options by
    QuantPolicy's field names; the job's own keywords as they are)."""
    from dataclasses import fields

    from kconvert.convert.layout import Topology
    from kconvert.convert.shard.job import ShardJob
    from kconvert.quant.policy import QuantPolicy

    names = {f.name for f in fields(QuantPolicy)}
    policy = QuantPolicy(quant, **{k: v for k, v in options.items() if k in names})
    return ShardJob(str(src), str(out), topology=Topology(tp=tp, ep=ep, pp=pp, pp_layers=pp_layers), quant=policy,
                    **{k: v for k, v in options.items() if k not in names})


def cli_runs(runs: dict) -> dict:
    """Each named CLI call of `runs` (name -> args) in this process, each required to succeed: name -> its result."""
    out = {}
    for key, args in runs.items():
        r = cli_here(*args)
        assert r.returncode == 0, (key, r.stderr)
        out[key] = r
    return out


def stored_tensors(folder: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor whose name starts with `prefix` in the safetensors files under `folder`."""
    from safetensors import safe_open

    out = {}
    for f in sorted(Path(folder).rglob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys() if k.startswith(prefix)})
    return out
