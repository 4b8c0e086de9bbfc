"""The CLI starts fast and its help cannot drift: `import cli.main`, `kconvert --help`, `--version` and a
mistyped command import no torch, transformers or engine (bench/cli_bench.py times them); option choices
and help that name schemes, export formats, KV dtypes and device presets come from the registries the code
uses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "engine", "safetensors", "numpy")


def test_import_and_help_version_typo_pull_in_no_torch():
    code = f"""
import contextlib, io, json, sys
import cli.main
seen = {{"import": [m for m in {HEAVY!r} if m in sys.modules]}}
for args in (["--help"], ["--version"], ["shrad"]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
        code = cli.main.main(args)
    seen[" ".join(args)] = [m for m in {HEAVY!r} if m in sys.modules]
    seen[" ".join(args) + " code"] = code
print(json.dumps(seen))
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout)
    assert seen["import"] == [] and seen["--help"] == [] and seen["--version"] == [] and seen["shrad"] == [], seen
    assert seen["--help code"] == 0 and seen["--version code"] == 0 and seen["shrad code"] == 2, seen


def _option(command: click.Command, name: str) -> click.Option:
    return next(p for p in command.params if isinstance(p, click.Option) and name in p.opts)


def test_help_comes_from_the_registries():
    from cli.main import app
    from kconvert.convert.export.job import DEFAULT_MAX_SHARD
    from kconvert.convert.export.table import FORMATS
    from kconvert.plan.device_presets import devices
    from kconvert.kv_rows import KV_DTYPES
    from kconvert.quant.registry import SHARD_SCHEMES
    from kconvert.quant.scheme import SCALE_FORMATS
    from cli.units import parse_size

    cmds = app.commands
    assert tuple(_option(cmds["shard"], "--quant").type.choices) == SHARD_SCHEMES
    assert tuple(_option(cmds["plan"], "--quant").type.choices) == SHARD_SCHEMES  # int4, fp4 included
    assert tuple(_option(cmds["export"], "--format").type.choices) == FORMATS
    for cmd, opt in (("shard", "--scale-format"), ("export", "--scale-format")):
        assert tuple(_option(cmds[cmd], opt).type.choices) == SCALE_FORMATS
    for cmd, opt in (("plan", "--kv-cache-dtype"), ("load", "--kv-dtype"), ("verify", "--kv-dtype")):
        assert tuple(_option(cmds[cmd], opt).type.choices) == KV_DTYPES, cmd
    assert all(key in _option(cmds["plan"], "--device").help for key in devices())
    from kconvert.devices import KNOWN

    device = _option(cmds["load"], "--device")
    assert all(f"{kind}[:i]" in device.get_help_record(click.Context(cmds["load"]))[1] for kind in KNOWN)
    assert parse_size(_option(cmds["export"], "--max-shard-size").default) == DEFAULT_MAX_SHARD
    assert "zstd:3" not in cmds["pack"].help  # level 1 measured best: the example uses the default
    assert "random weights, real names" not in cmds["fixture"].help and "--complete" in cmds["fixture"].help


def test_ctrl_c_says_how_to_resume_where_the_same_command_resumes(monkeypatch, tmp_path):
    from helpers import cli_here
    from kconvert.convert import pack
    from kconvert.disk_format import integrity

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(pack, "pack", interrupted)
    monkeypatch.setattr(integrity, "verify_files", interrupted)
    r = cli_here("pack", tmp_path)
    assert r.returncode == 130 and r.stderr.strip() == (
        "kconvert: interrupted: run the same command again to resume (finished files are kept)"), r.stderr
    r = cli_here("verify-files", tmp_path)  # nothing to resume: a check starts over
    assert r.returncode == 130 and r.stderr.strip() == "kconvert: interrupted", r.stderr
