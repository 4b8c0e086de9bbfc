"""A non-editable install must carry the manifests (family files, parts, examples, device presets)."""

from __future__ import annotations

import subprocess
import sys

from helpers import ROOT


def test_wheel_install_finds_manifests(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "wheel"), str(ROOT)], check=True, capture_output=True)
    wheel = next((tmp_path / "wheel").glob("kconvert-*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(tmp_path / "site"),
                    str(wheel)], check=True, capture_output=True)
    probe = ("import kconvert.family.manifest as m, pathlib; d = m.manifests_dir(); "
             "assert str(d).startswith(%r), d; "
             "print(sorted(p.name for p in d.rglob('*.toml')), (d / 'examples/k25-dsv32-3t/config.json').exists())"
             % str(tmp_path / "site"))
    r = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                       env={"PYTHONPATH": str(tmp_path / "site"), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    for name in ("kimi_k25.toml", "deepseek_v32.toml", "deepseek_v3.toml", "devices.toml", "deepseek_text.toml",
                 "dsa_indexer.toml", "moonvit.toml", "kimi_projector.toml"):
        assert name in r.stdout, (name, r.stdout)
    assert r.stdout.strip().endswith("True")
