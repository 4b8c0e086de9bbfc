"""bench/device_check.py, the one prepared GPU run, works end to end here on CPU with small sizes
(verify is left out for time: `--device standin --quick` runs it on the stand-in, see docs/LOADER.md)."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers import ROOT


def test_device_check_runs_on_cpu(tmp_path):
    out = tmp_path / "check.json"
    r = subprocess.run([sys.executable, "bench/device_check.py", "--device", "cpu", "--quick", "--skip", "verify",
                        "--workdir", str(tmp_path / "work"), "--out", str(out)], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = json.loads(out.read_text())
    steps = rep["steps"]
    assert {k: v["status"] for k, v in steps.items()} == {
        "env": "ok", "h2d": "skipped", "build": "ok", "load": "ok", "ready": "ok", "verify": "skipped",
        "decode": "ok", "tp2": "skipped"}
    rows = steps["load"]["rows"]
    assert set(rows) == {f"{c}/{w}" for c in ("kconvert", "load_file", "safe_open+to") for w in ("first", "warm")}
    assert all(v["GBps"] > 0 for v in rows.values()) and steps["load"]["bytes"] > 4_000_000
    assert steps["ready"]["phases"]["warmup"] > 0
    assert set(steps["decode"]["contexts"]) == {"32", "64"}
    for name in ("h2d", "verify", "tp2"):  # each skip says why, in the JSON and on stdout
        assert steps[name]["why"] and f"not measured: {name}: " in r.stdout
    assert "step" in r.stdout and "load" in r.stdout  # the table
