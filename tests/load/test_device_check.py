"""tools/device_check.py, the one prepared GPU run, works end to end here on CPU with small sizes
(verify is left out for time: `--device standin --quick` runs it on the stand-in, see docs/LOADER.md)."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers import ROOT


def test_device_check_runs_on_cpu(tmp_path):
    out = tmp_path / "check.json"
    r = subprocess.run([sys.executable, "tools/device_check.py", "--device", "cpu", "--quick", "--skip", "verify",
                        "--workdir", str(tmp_path / "work"), "--out", str(out)], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = json.loads(out.read_text())
    steps = rep["steps"]
    assert {k: v["status"] for k, v in steps.items()} == {
        "env": "ok", "h2d": "skipped", "build": "ok", "load": "ok", "ready": "ok", "verify": "skipped",
        "decode": "ok", "decode_v4": "skipped", "tp2": "skipped"}
    rows = steps["load"]["rows"]
    assert set(rows) == {f"{c}/{w}" for c in ("kconvert", "load_file", "safe_open+to") for w in ("first", "warm")}
    assert all(v["GBps"] > 0 for v in rows.values()) and steps["load"]["bytes"] > 4_000_000
    assert steps["ready"]["phases"]["warmup"] > 0
    assert set(steps["decode"]["contexts"]) == {"32", "64"}
    for name in ("h2d", "verify", "tp2"):  # each skip says why, in the JSON and on stdout
        assert steps[name]["why"] and f"not measured: {name}: " in r.stdout
    assert "step" in r.stdout and "load" in r.stdout  # the table


def test_a_verify_fail_is_shown_as_fail_and_builds_are_kept_apart_by_size(monkeypatch, tmp_path):
    """A verify whose faithfulness FAILs is the step's FAIL (status, table, exit), never "ok"; its cost over budget
    (fp8 on random weights) is reported, not judged; the default build folder is
    keyed by the sizes, so a --quick run never reuses a full-size build nor the other way round."""
    import importlib.util
    from types import SimpleNamespace

    spec = importlib.util.spec_from_file_location("device_check", ROOT / "tools" / "device_check.py")
    dc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dc)
    import kconvert.verify.verdict as verdict

    def report(faithful: str, cost: str):
        def run_verify(out, **kw):
            assert kw["against"] == "src"  # faithfulness judged against the source, never skipped for want of it
            faith = SimpleNamespace(verdict=faithful, overall={"mean_kld": 0.5 if faithful == "FAIL" else 1e-9},
                                    reference="fake-quantized source", failures=[] if faithful == "PASS" else
                                    ["mean KLD 0.5 > 1e-05"])
            spent = SimpleNamespace(verdict=cost, overall={"mean_kld": 0.0475})
            return SimpleNamespace(verdict="FAIL" if "FAIL" in (faithful, cost) else "PASS", faithfulness=faith,
                                   cost=spent, seconds=0.1, failures=[])
        return run_verify

    paths = {"tiny-k25-dsv32-none": "a", "tiny-k25-dsv32-fp8": "b", "tiny-k25-dsv32-ref": "r", "tiny-k25-dsv32-src": "src"}
    # issue 42: a healthy machine, fp8 over its cost budget on random weights: faithful, so the step is ok
    monkeypatch.setattr(verdict, "run_verify", report("PASS", "FAIL"))
    run = dc.Run(budget=60)
    run.step("verify", dc.verify, "cpu", paths, ["tiny-k25-dsv32"])
    assert run.steps["verify"]["status"] == "ok"
    assert "cost 4.75e-02, FAIL on its budget, not judged" in dc.table(run.steps)
    monkeypatch.setattr(verdict, "run_verify", report("FAIL", "PASS"))  # a damaged conversion or a wrong device
    run.step("verify", dc.verify, "cpu", paths, ["tiny-k25-dsv32"])
    assert run.steps["verify"]["status"] == "FAIL"
    row = next(line for line in dc.table(run.steps).splitlines() if line.startswith("verify"))
    assert row.split()[1] == "FAIL" and " ok " not in row, row
    quick, full = dc.default_workdir(8 << 20, ["tiny-k25-dsv32"]), dc.default_workdir(4 << 30, ["tiny-k25-dsv32", "small-k25-dsv32"])
    assert quick != full and quick.parent == full.parent
