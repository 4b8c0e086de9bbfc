"""Render one chat template in a throw-away process (run by engine/inputs/template.py as `python -P THIS`).

Reads {"template", "context", "max_output", "cpu_seconds"} as JSON on stdin, writes {"text"} or {"error", "kind"} on stdout.
It caps its own address space and CPU time before importing jinja2, and stops as soon as the output
passes max_output, so a hostile template ends here, not in the engine. Standard library + jinja2 only."""

import json
import resource
import sys

MEMORY_BYTES = 1 << 30


def _limit(cpu_seconds: int) -> None:
    for res, value in ((resource.RLIMIT_AS, MEMORY_BYTES), (resource.RLIMIT_CPU, cpu_seconds)):
        soft, hard = resource.getrlimit(res)
        cap = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(res, (cap, hard))


def _render(job: dict) -> dict:
    from jinja2 import TemplateError, TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

    def raise_exception(message):  # the helper Hugging Face templates call to refuse a conversation
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        template = env.from_string(job["template"])
    except TemplateSyntaxError as e:
        return {"kind": "syntax", "error": f"line {e.lineno}: {e.message}"}
    parts, size = [], 0
    try:
        for chunk in template.generate(**job["context"]):
            parts.append(chunk)
            size += len(chunk)
            if size > job["max_output"]:
                return {"kind": "size", "error": f"output passed {job['max_output']} characters"}
    except SecurityError as e:
        return {"kind": "sandbox", "error": str(e)}
    except TemplateError as e:
        return {"kind": "template", "error": f"{e.__class__.__name__}: {e}"}
    except MemoryError:
        return {"kind": "memory", "error": f"needed more than {MEMORY_BYTES >> 20} MiB"}
    except RecursionError:
        return {"kind": "template", "error": "recursion too deep"}
    except Exception as e:  # a template is a program: any failure of it is the template's, reported as such
        return {"kind": "template", "error": f"{e.__class__.__name__}: {e}"}
    return {"text": "".join(parts)}


def main() -> None:
    job = json.loads(sys.stdin.read())
    _limit(job["cpu_seconds"])
    try:
        result = _render(job)
    except MemoryError:
        result = {"kind": "memory", "error": f"needed more than {MEMORY_BYTES >> 20} MiB"}
    sys.stdout.write(json.dumps(result))


if __name__ == "__main__":
    main()
