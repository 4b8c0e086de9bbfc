"""`kconvert serve-check` and `export --check vllm` without a vLLM environment: one line saying how to make it, exit
2, and `export --check` says so before it writes anything. (The checks themselves run in tests/vllm.)"""

from __future__ import annotations

from helpers import cli_here


def test_no_vllm_environment_is_one_line_naming_how_to_make_it(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("KCONVERT_VLLM_PYTHON", str(tmp_path / "no-such-python"))
    src = checkpoint("tiny-dsv3")
    r = cli_here("serve-check", src)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "make vllm-env" in r.stderr and "KCONVERT_VLLM_PYTHON" in r.stderr
    r = cli_here("export", src, tmp_path / "out", "--format", "bf16", "--check", "vllm")
    assert r.returncode == 2 and "make vllm-env" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()
