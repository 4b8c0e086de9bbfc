"""The tour and docs/COMMANDS.md's examples, run as written, so neither can drift from the CLI.

Two documents (DOCS): docs/TOUR.md's "## A five-command tour" section (the README lists the same five command
lines without their output: test_readme_tour_is_the_tour compares the text, nothing runs twice) and the whole
of docs/COMMANDS.md. Every command line of their ```bash blocks (a line ending in a backslash goes on with the
next) is its own test case.
A document's lines run in order, in one temporary directory of its own (each line may use what an earlier one
of the same document made, as a reader following along would), with `kconvert` = this checkout's CLI (its entry
point, in this process: run_line), `torchrun` = torch.distributed.run and `python` = this interpreter.
What a document's lines need and a reader would already have is made first (PRECONDITIONS); a `kconvert
fixture` line of a preset in LINKED_FIXTURES is met by the session's cached build, linked, not rebuilt; a line
that cannot run here is skipped only by a rule in SKIP, with its reason; a flag that needs an uninstalled
optional package is dropped by a rule in DROP. Every `kconvert` command named in docs/COMMANDS.md's table must
exist, and every option the table names must be in its --help."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import subprocess
import sys

import pytest

from helpers import ROOT, cli_here, one_thread

# document -> (file, the section whose bash blocks run: a "## " heading, or None for the whole file)
DOCS = {"tour": ("docs/TOUR.md", "## A five-command tour"), "commands": ("docs/COMMANDS.md", None)}
README_TOUR = "## A five-command tour"  # the README's section that lists the tour's command lines
README_MAX_LINES = 100  # the README is one screen; everything else lives in docs/ (docs/README.md is the index)

# line pattern -> why it cannot run in this test (keep short: each one is a line nobody checks)
SKIP = {
    r"\bSRC\b|\bOUT\b": "placeholders, not paths (the torchrun lines: --tp 8 needs more heads than any CPU-sized "
                        "fixture has, and two nodes; multi-process shard is tested in tests/convert/test_shard.py)",
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


def section_of(path: str, heading: str | None) -> str:
    """The text of `path` under the "## " heading `heading` (to the next "## "), or the whole file for None."""
    text = (ROOT / path).read_text()
    if heading is None:
        return text
    start = text.index("\n" + heading + "\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else len(text)]


def section(doc: str) -> str:
    return section_of(*DOCS[doc])


def command_lines(doc: str) -> list[str]:
    return bash_lines(section(doc))


def bash_lines(text: str) -> list[str]:
    """The command lines of the ```bash blocks in `text`, comment lines left out."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        block = re.sub(r"\\\n\s*", " ", block)  # a continued line is one command
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
    assert argv[0] in PROGRAMS, f"documented command with an unknown program: {line}"
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


def linked_fixture(line: str) -> tuple[str, str] | None:
    """(preset, OUT) of a `kconvert fixture` line that LINKED_FIXTURES satisfies, else None."""
    words = shlex.split(line, comments=True)
    if words[:2] == ["kconvert", "fixture"] and len(words) > 3 and words[2] in LINKED_FIXTURES:
        return words[2], words[3]
    return None


def commands_preconditions(d, checkpoint) -> None:
    """What docs/COMMANDS.md's examples take as given (its Examples section says so): a block-FP8 checkpoint."""
    (d / "tiny-k25-dsv32-fp8").symlink_to(checkpoint("tiny-k25-dsv32-fp8"))


# document -> what a reader brings before its first line (the tour starts in an empty directory)
PRECONDITIONS = {"commands": commands_preconditions}

LINES = {doc: command_lines(doc) for doc in DOCS}
CASES = [pytest.param(doc, line, id=f"{doc}: {line}") for doc, lines in LINES.items() for line in lines]


@pytest.fixture(scope="module")
def workdirs(checkpoint, tmp_path_factory):
    """workdirs(doc) -> the directory a document's lines run in, made once with its PRECONDITIONS and its
    linked fixtures (the session's builds of the same preset and seed: the same bytes;
    tests/fixtures/test_fixtures.py runs the command itself)."""
    made = {}

    def get(doc: str):
        if doc not in made:
            d = tmp_path_factory.mktemp(f"readme-{doc}")
            if doc in PRECONDITIONS:
                PRECONDITIONS[doc](d, checkpoint)
            for line in LINES[doc]:
                if (linked := linked_fixture(line)) is not None:
                    preset, out = linked
                    (d / out).symlink_to(checkpoint(preset))
            made[doc] = d
        return made[doc]

    return get


def test_the_documents_have_commands():
    assert len(LINES["commands"]) >= 8, LINES["commands"]
    assert len(LINES["tour"]) == 5, LINES["tour"]  # the README promises a five-command tour


def test_readme_tour_is_the_tour():
    """The README's tour lists exactly docs/TOUR.md's command lines, in order (TOUR's are the ones that run)."""
    assert bash_lines(section_of("README.md", README_TOUR)) == LINES["tour"]


def test_readme_is_one_screen():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}): move the detail into docs/"


@pytest.mark.parametrize("doc,line", CASES)
def test_documented_line_runs(doc, line, workdirs):
    workdir = workdirs(doc)
    if (linked := linked_fixture(line)) is not None:
        assert (workdir / linked[1]).is_dir()  # built by the session's fixture (see workdirs)
        return
    argv, why = prepared(line)
    if argv is None:
        pytest.skip(why)
    p = run_line(argv, workdir)
    assert p.returncode == 0, f"{DOCS[doc][0]} line failed ({p.returncode}): {line}\n{p.stderr[-3000:]}"
    assert "Traceback" not in p.stderr, p.stderr


def test_table_commands_and_options_exist():
    from click.testing import CliRunner

    from cli.main import app

    text = section("commands")
    table = text[text.index("\n## The commands\n"):text.index("\n## ", text.index("\n## The commands\n") + 1)]
    rows = re.findall(r"^\| `kconvert ([a-z-]+)([^`]*)`", table, re.M)
    assert len(rows) >= 8, rows
    for name, rest in rows:
        result = CliRunner().invoke(app, [name, "--help"])
        assert result.exit_code == 0, (name, result.output)
        for option in re.findall(r"--[a-z][a-z-]*", rest):
            assert option in result.output, f"docs/COMMANDS.md names `kconvert {name} {option}`, which --help lacks"
