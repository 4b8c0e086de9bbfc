"""Render a checkpoint's chat template (jinja) without trusting it.

A template is a program shipped with the checkpoint. jinja2's sandbox (ImmutableSandboxedEnvironment,
jinja2 >= 3.1.6 without the published escapes) keeps it from reaching Python objects, but not from
looping for hours (`range` is capped, nested loops are not) or building a string of gigabytes in one
operation (`'x' * 10**10`, `|center(10**10)`, `'%*s' % ...`), which no check between template lines can
interrupt. So rendering happens in a short-lived child process (engine/inputs/template_worker.py, started with
-P so engine/ is not on its import path) with an address-space cap, a CPU-time cap, an output-size cap
and a wall-clock timeout: whatever the template does, the engine gets text or a one-line error within
TIMEOUT_S. Cost: one Python start-up (~0.1 s) per rendered turn.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kconvert.errors import ChatTemplateError

TIMEOUT_S = 15.0
MAX_OUTPUT_CHARS = 16 << 20  # a 1M-token conversation is about 4 MB of text
WORKER = Path(__file__).with_name("template_worker.py")


def render(template: str, context: dict, where: str, timeout_s: float = TIMEOUT_S) -> str:
    """The template rendered with `context`, or ChatTemplateError naming `where` (file and field)."""
    # the CPU limit is a backstop a second past the wall-clock timeout, which decides (one clear message)
    job = json.dumps({"template": template, "context": context, "max_output": MAX_OUTPUT_CHARS,
                      "cpu_seconds": int(timeout_s) + 1})
    try:
        proc = subprocess.run([sys.executable, "-P", str(WORKER)], input=job.encode(), capture_output=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise ChatTemplateError(f"chat template did not finish rendering within {timeout_s:g} s",
                                file=where) from None
    try:
        result = json.loads(proc.stdout)
    except ValueError:
        why = f"was killed (signal {-proc.returncode})" if proc.returncode < 0 else f"failed (exit {proc.returncode})"
        raise ChatTemplateError(f"chat template rendering {why}: it exceeded the CPU or memory limit",
                                file=where) from None
    if "text" in result:
        return result["text"]
    kind = {"syntax": "syntax error", "sandbox": "refused by the sandbox", "size": "output too large",
            "memory": "used too much memory", "template": "failed"}.get(result.get("kind"), "failed")
    raise ChatTemplateError(f"chat template {kind}: {result.get('error', '')}", file=where)
