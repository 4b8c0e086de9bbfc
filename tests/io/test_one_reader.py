"""Issue 42, class 1: every file kconvert opens for reading goes through one bounded, regular-file-only reader
(kconvert/io/regular.py). A FIFO in place of a rank's tensor list, a shard or a kept calibration input used to
block `load`, `verify-files`, `inspect`, `pack`, `unpack`, chat and a calibrated resume forever; each is now one
line, exit 2, at once. The source check below fails on any read-only open elsewhere (a new reader that forgets
the rule), with a negative control."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT, assert_one_line_error, cli_here

# Reads that do not go through kconvert/io/regular.py, each with why it may not.
ALLOWED = {
    "kconvert/io/regular.py": "the reader itself",
    "kconvert/io/atomic.py": "opens a directory to fsync it (no data read)",
    "kconvert/io/dir_lock.py": "opens a directory to lock it (no data read)",
    "kconvert/host_memory.py": "/proc/meminfo and /proc/self/status",
    "kconvert/fixtures/kernels.py": "/proc/cpuinfo's flags, before torch is imported",
    "kconvert/distributed.py": "/proc/PID/stat",
    "kconvert/family/limits.py": "manifests/limits.toml, shipped in the package",
    "kconvert/family/families.py": "manifests/*.toml, shipped in the package",
    "kconvert/plan/device_presets.py": "manifests/devices.toml, shipped in the package",
    "kconvert/verify/verdict.py": "manifests/verify_thresholds.toml; results its own ranks wrote under the work dir",
    "kconvert/verify/thresholds.py": "manifests/verify_thresholds.toml, shipped in the package",
    "kconvert/verify/run.py": "results its own ranks wrote under the run's work dir",
    "kconvert/verify/reference.py": "safe_open after check_regular (a FIFO refused first)",
    "kconvert/verify/damage.py": "damages conversions for tests and bench/verify_damage.py",
    "kconvert/verify/mlx_draft.py": "config.json already read by Checkpoint.open (MTP work in progress: move to "
                                    "side_files.read_json)",
    "kconvert/convert/output_dir.py": "shutil.copyfile after check_regular and a size check",
    "kconvert/verify/vllm_check/check.py": "results the vLLM driver wrote under serve-check's own work dir",
    "kconvert/verify/vllm_check/env.py": "result.json the vLLM driver wrote under serve-check's own work dir",
    "kconvert/verify/vllm_check/driver.py": "runs in vLLM's own environment, where kconvert is never imported",
    "kconvert/verify/vllm_check/vllm_load.py": "runs in vLLM's own environment (the driver's), no kconvert there",
    "kconvert/verify/vllm_check/vllm_dequant.py": "runs in vLLM's own environment (the driver's), no kconvert there",
    "cli/fixture_cmd.py": "kconvert_training.json the fixture command has just written",
}
PACKAGES = ("kconvert", "engine", "cli")
_READERS = {"load_file", "safe_open", "fromfile", "copyfile", "copy", "copy2"}  # library readers of a path


def _text(node: ast.AST) -> str:
    return ast.unparse(node)


def reads_of(path: Path) -> list[str]:
    """Read-only opens in one file: open() without a writing mode, os.open without a writing flag,
    Path.read_bytes() / read_text(), and library readers handed a path (load_file, safe_open, Image.open...)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        if node.args and isinstance(node.args[0], ast.Call) and _text(node.args[0].func).endswith("regular_file"):
            continue  # a library reading a file object the one reader opened
        f, what = node.func, None
        if isinstance(f, ast.Name) and f.id == "open":
            mode = node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords if k.arg == "mode"), None)
            if mode is None or not any(c in _text(mode) for c in "wax+"):
                what = "open()"
        elif isinstance(f, ast.Attribute):
            owner = _text(f.value)
            if f.attr == "open" and owner == "os" and node.args and \
                    not any(flag in _text(node.args[1]) for flag in ("O_WRONLY", "O_RDWR", "O_CREAT", "_CREATE")):
                what = "os.open()"
            elif f.attr in ("read_bytes", "read_text") and not node.args:
                what = f".{f.attr}()"
            elif f.attr == "open" and owner == "Image":
                what = "Image.open()"
            elif f.attr in _READERS and owner in ("shutil", "np", "numpy", "safetensors", "safetensors.torch"):
                what = f"{owner}.{f.attr}()"
            elif f.attr == "load" and owner == "tomllib":
                what = "tomllib.load()"
        elif isinstance(f, ast.Name) and f.id in ("load_file", "safe_open"):
            what = f"{f.id}()"
        if what:
            found.append(f"{path.relative_to(ROOT) if ROOT in path.parents else path.name}:{node.lineno} {what}")
    return found


def unchecked_reads(root: Path = ROOT) -> list[str]:
    out = []
    for pkg in PACKAGES:
        for p in sorted((root / pkg).rglob("*.py")):
            rel = str(p.relative_to(root))
            if rel.startswith("kconvert/fixtures/") or rel in ALLOWED:
                continue
            out += reads_of(p)
    return out


def test_every_read_goes_through_the_one_reader():
    bad = unchecked_reads()
    assert not bad, "files opened for reading outside kconvert/io/regular.py:\n" + "\n".join(bad)


def test_the_read_check_fails_on_a_synthetic_violation(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("import os\nfrom pathlib import Path\n"
                 "def f(x):\n    a = open(x)\n    b = open(x, 'rb')\n    c = open(x, 'wb')\n"
                 "    d = os.open(x, os.O_RDONLY)\n    e = os.open(x, os.O_WRONLY | os.O_CREAT)\n"
                 "    g = Path(x).read_bytes()\n    h = load_file(x)\n    i = Image.open(x)\n"
                 "    j = Image.open(regular_file(x))\n")
    assert [r.split(" ", 1)[1] for r in reads_of(p)] == ["open()", "open()", "os.open()", ".read_bytes()",
                                                          "load_file()", "Image.open()"]


def test_the_reader_refuses_what_is_not_a_regular_file(tmp_path):
    from kconvert.errors import CheckpointError, MissingFileError
    from kconvert.io.regular import open_regular

    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    for name, kind in (("fifo", "a FIFO"), ("dir", "a directory")):
        with pytest.raises(CheckpointError, match=f"is {kind}.*, not a regular file"):
            open_regular(tmp_path / name)
    with pytest.raises(CheckpointError, match="a character device"):
        open_regular("/dev/zero")
    with pytest.raises(MissingFileError):
        open_regular(tmp_path / "nope")
    (tmp_path / "f").write_bytes(b"abc")
    fd, size = open_regular(tmp_path / "f")
    assert size == 3 and os.read(fd, 10) == b"abc"
    os.close(fd)


@pytest.fixture(scope="module")
def pristine(conversion):
    return conversion("tiny-k25-dsv32", tp=2, quant="fp8")


@pytest.fixture
def converted(pristine, tmp_path):
    """A private copy of a tp 2 fp8 conversion (its files are swapped for FIFOs)."""
    out = tmp_path / "tp2"
    shutil.copytree(pristine, out)
    return out


def _as_fifo(f: Path) -> bytes:
    data = f.read_bytes()
    f.unlink()
    os.mkfifo(f)
    return data


COMMANDS = [("verify-files", "{out}"), ("load", "{out}", "--rank", "1", "--device", "cpu"),
            ("load", "{out}", "--rank", "1", "--device", "cpu", "--verify"), ("inspect", "{out}"),
            ("unpack", "{out}"), ("pack", "{out}")]


@pytest.mark.parametrize("rel", ["rank-001/tensors.json", "rank-001/layer-0001.safetensors"])
def test_a_fifo_in_a_converted_directory_is_one_line(converted, deadline, rel):
    f = converted / rel
    data = _as_fifo(f)
    for args in COMMANDS:
        args = [a.format(out=converted) for a in args]
        if args[0] in ("inspect", "unpack") and rel.endswith(".safetensors"):
            continue  # they read the tensor lists, not the (plain) shards
        assert_one_line_error(cli_here(*args), rel.split("/")[1], "FIFO")
    f.unlink()
    f.write_bytes(data)


def test_chat_on_a_fifo_rank_list_is_one_line(converted):
    f = converted / "rank-000/tensors.json"
    data = _as_fifo(f)
    try:
        p = subprocess.run([sys.executable, "-m", "engine.chat", str(converted), "--prompt", "hi", "--max-new-tokens", "1"],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
    finally:
        f.unlink()
        f.write_bytes(data)
    assert p.returncode == 2 and "tensors.json" in p.stderr and "FIFO" in p.stderr and "Traceback" not in p.stderr, p.stderr
