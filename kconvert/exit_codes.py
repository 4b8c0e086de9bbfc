"""How a run ends: every error becomes one line and an exit code, written once for `kconvert` (cli/main.py)
and `python -m engine.chat`.

Exit codes: a KConvertError's own (2 bad input, 1 a check that ran and failed), 130 interrupted, a missing
optional package as its DependencyError (kconvert.deps), 3 an internal error (a bug of ours; set
KCONVERT_DEBUG=1 for its traceback). The caller says how a line is shown (`say`); nothing here prints."""

from __future__ import annotations

import os
from typing import Callable

from kconvert.errors import KConvertError

INTERRUPTED = 130
INTERNAL = 3


def run_reporting_errors(body: Callable[[], int], say: Callable[[str], object], *,
                         interrupts: tuple[type[BaseException], ...] = (KeyboardInterrupt,),
                         on_internal: Callable[[Exception], int | None] | None = None) -> int:
    """body()'s exit code, or the code of the error that ended it after `say`ing its one line
    ("error: ...", "interrupted", "internal error: ..."). `interrupts`: exceptions that mean Ctrl-C (a CLI
    framework's own Abort). `on_internal(e)`: a code to return instead of calling `e` internal (a peer
    rank's failure that caused it), or None."""
    try:
        return body()
    except KConvertError as e:
        say(f"error: {e.one_line()}")
        return e.exit_code
    except interrupts:
        say("interrupted")
        return INTERRUPTED
    except ModuleNotFoundError as e:  # an optional package (the `ref` extra, matplotlib...) is not installed
        from kconvert.deps import from_import_error

        dep = from_import_error(e)
        if dep is None:
            return _internal(e, say, on_internal)
        say(f"error: {dep.one_line()}")
        return dep.exit_code
    except Exception as e:
        return _internal(e, say, on_internal)


def _internal(e: Exception, say, on_internal) -> int:
    """A bug of ours: still one line, with a way to get the traceback."""
    if on_internal is not None:
        code = on_internal(e)
        if code is not None:
            return code
    if os.environ.get("KCONVERT_DEBUG"):
        raise e
    say(f"internal error: {e.__class__.__name__}: {e} (set KCONVERT_DEBUG=1 for a traceback)")
    return INTERNAL
