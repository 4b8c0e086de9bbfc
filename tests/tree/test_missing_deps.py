"""Without an optional package (the `ref` extra's transformers, matplotlib for --plot) a command ends with
exit 2 and one line giving the exact install command, never an internal error. The packages are hidden
from the CLI's interpreter by an import hook, as if they had never been installed."""

from __future__ import annotations

import subprocess
import sys

from helpers import ROOT

HIDE = """
import sys
class _NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {hidden!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, _NotInstalled())
from cli.main import main
sys.exit(main({argv!r}))
"""


def kconvert_without(hidden: set[str], *argv) -> subprocess.CompletedProcess:
    code = HIDE.format(hidden=sorted(hidden), argv=[str(a) for a in argv])
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)


def assert_install_line(p: subprocess.CompletedProcess, package: str, extra: str) -> None:
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in p.stderr, (p.returncode, p.stderr)
    line = lines[0]
    assert f"{sys.executable} -m pip install '{package}" in line and f"`{extra}` extra" in line, line


def test_fixture_without_transformers(tmp_path):
    p = kconvert_without({"transformers"}, "fixture", "tiny-k25-dsv32", tmp_path / "out")
    assert_install_line(p, "transformers==", "ref")
    assert not (tmp_path / "out" / "config.json").exists()


def test_reference_without_transformers(checkpoint, tmp_path):
    p = kconvert_without({"transformers"}, "reference", checkpoint("tiny-k25-dsv32"), "--out", tmp_path / "ref.safetensors")
    assert_install_line(p, "transformers==", "ref")
    assert not (tmp_path / "ref.safetensors").exists()


def test_verify_plot_without_matplotlib_fails_before_verifying(tmp_path):
    # OUT and the reference need not be valid: --plot is checked before anything is read
    p = kconvert_without({"matplotlib"}, "verify", tmp_path, "--reference", tmp_path / "ref.safetensors",
                         "--plot", tmp_path / "v.png")
    assert_install_line(p, "matplotlib>=", "plot")


def test_an_unknown_missing_module_stays_an_internal_error():
    from kconvert.deps import from_import_error

    assert from_import_error(ModuleNotFoundError("No module named 'kconvert_typo'", name="kconvert_typo")) is None
    assert from_import_error(ModuleNotFoundError("x", name="transformers.models.kimi_k25")) is not None


def test_reference_of_kimi_k3_without_mlx(checkpoint, tmp_path):
    p = kconvert_without({"mlx", "mlx_lm", "mlx_vlm"}, "reference", checkpoint("tiny-kimi-k3"), "--out",
                         tmp_path / "ref.safetensors")
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert f"{sys.executable} -m pip install mlx==" in lines[0] and "`mlx` extra" in lines[0], lines[0]
    assert "mlx-cpu==" in lines[0]  # MLX's Linux CPU backend, without which it does not run here
    assert not (tmp_path / "ref.safetensors").exists()
