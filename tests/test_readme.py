"""The README's Commands section, run as written, so it cannot drift from the CLI.

Every command line of its ```bash block runs in order, in one temporary directory (each line may use what
an earlier one made, as a reader following along would), with `kconvert` = this checkout's CLI (its entry
point, in this process: run_line), `torchrun` = torch.distributed.run and `python` = this interpreter.
What a line needs and a reader would already have is made first (PRECONDITIONS); a line that cannot run
here is skipped only by a rule in SKIP, with its reason; a flag that needs an uninstalled optional package
is dropped by a rule in DROP. Every `kconvert` command named in the section's table must exist, and every
option the table names must be in its --help."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import subprocess
import sys

import pytest

from helpers import ROOT, cli_here, one_thread

# line pattern -> why it cannot run in this test (keep short: each one is a line nobody checks)
SKIP = {
    r"\bSRC\b|\bOUT\b": "placeholders, not paths (the torchrun line: --tp 8 needs more heads than any CPU-sized "
                        "fixture has; multi-process shard is tested in tests/test_shard.py)",
    r"--device (cuda|musa)": "needs a GPU",
}  # and any line with a Hub repo id (owner/name) as an argument: needs_hub()
# flag pattern -> (module it needs, why it is dropped when that module is missing)
DROP = {r"--plot \S+": ("matplotlib", "matplotlib is the `plot` extra, not installed by `make test`")}


PROGRAMS = {"kconvert": [sys.executable, "-m", "cli.main"], "torchrun": [sys.executable, "-m", "torch.distributed.run"],
            "python": [sys.executable]}

# presets whose `kconvert fixture` line is satisfied from the session's cache (training one takes minutes)
LINKED_FIXTURES = ("tiny-k25-dsv32-trained",)


def needs_hub(argv: list[str]) -> bool:
    """An argument that is a Hub repo id (owner/name) rather than a local path."""
    return any(re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", a) and not a.startswith(".") and "." not in a.split("/")[0]
               and not a.endswith((".png", ".safetensors")) for a in argv[1:])


def commands_section() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("\n## Commands")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def command_lines() -> list[str]:
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", commands_section(), re.S):
        lines += [l.strip() for l in block.splitlines() if l.strip() and not l.strip().startswith("#")]
    return lines


def prepared(line: str) -> tuple[list[str] | None, str | None]:
    """(argv to run, None) or (None, why it is skipped)."""
    for pattern, why in SKIP.items():
        if re.search(pattern, line):
            return None, why
    for pattern, (module, why) in DROP.items():
        if re.search(pattern, line):
            try:
                __import__(module)
            except ImportError:
                line = re.sub(pattern, "", line)
    argv = shlex.split(line, comments=True)
    if needs_hub(argv):
        return None, "needs the Hugging Face Hub"
    assert argv[0] in PROGRAMS, f"README command with an unknown program: {line}"
    return argv, None


# kconvert lines that run as processes: engine.runtime.launch makes the process that starts the ranks rank 0 (its
# environment says so), which this test process must not become
OWN_PROCESS = (r"\bload\b.*--warmup",)


def run_line(argv: list[str], workdir) -> subprocess.CompletedProcess:
    """A `kconvert` line through the CLI's entry point in this process, in workdir (no interpreter start and
    torch import per line; ranks a line spawns are still processes), unless OWN_PROCESS names it; the others
    as processes (this checkout first on the path)."""
    if argv[0] == "kconvert" and not any(re.search(p, shlex.join(argv)) for p in OWN_PROCESS):
        env = dict(os.environ)
        with contextlib.chdir(workdir), one_thread():
            p = cli_here(*argv[1:])
        assert dict(os.environ) == env, f"`{shlex.join(argv)}` changed the environment: add it to OWN_PROCESS"
        return p
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run(PROGRAMS[argv[0]] + argv[1:], cwd=workdir, capture_output=True, text=True, timeout=900,
                          env=env)


LINES = command_lines()


@pytest.fixture(scope="module")
def workdir(checkpoint, tmp_path_factory):
    """Where the lines run, holding what a reader would bring: a block-FP8 checkpoint and a picture."""
    from kconvert.verify.prompts import synthetic_image

    d = tmp_path_factory.mktemp("readme")
    (d / "tiny-k25-dsv32-fp8").symlink_to(checkpoint("tiny-k25-dsv32-fp8"))
    for line in LINES:  # fixtures the session has built already are linked, not rebuilt (same preset and seed:
        argv = shlex.split(line, comments=True)  # the same bytes; tests/test_fixtures.py runs the command itself)
        if argv[:2] == ["kconvert", "fixture"] and argv[2] in LINKED_FIXTURES:
            (d / argv[3]).symlink_to(checkpoint(argv[2]))
    synthetic_image(3, 84, 56).save(d / "picture.png")
    return d


def test_the_section_has_commands():
    assert len(LINES) >= 8, LINES


@pytest.mark.parametrize("line", LINES)
def test_readme_line_runs(line, workdir):
    words = shlex.split(line, comments=True)
    if words[:2] == ["kconvert", "fixture"] and words[2] in LINKED_FIXTURES:
        assert (workdir / words[3]).is_dir()  # built by the session's fixture (see workdir)
        return
    argv, why = prepared(line)
    if argv is None:
        pytest.skip(why)
    p = run_line(argv, workdir)
    assert p.returncode == 0, f"README line failed ({p.returncode}): {line}\n{p.stderr[-3000:]}"
    assert "Traceback" not in p.stderr, p.stderr


def test_table_commands_and_options_exist():
    from click.testing import CliRunner

    from cli.main import app

    rows = re.findall(r"^\| `kconvert ([a-z-]+)([^`]*)`", commands_section(), re.M)
    assert len(rows) >= 8, rows
    for name, rest in rows:
        result = CliRunner().invoke(app, [name, "--help"])
        assert result.exit_code == 0, (name, result.output)
        for option in re.findall(r"--[a-z][a-z-]*", rest):
            assert option in result.output, f"README names `kconvert {name} {option}`, which --help lacks"
