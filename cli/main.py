"""Entry point: the click group, and the one place that turns errors into exit codes.

Exit codes: 0 success, 1 a check that ran and failed (verify), 2 bad input (one line, no traceback),
3 internal error, 130 interrupted (kconvert/exit_codes.py). Set KCONVERT_DEBUG=1 to see tracebacks of
unexpected errors.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import threading

import click

from kconvert import __version__
from kconvert.exit_codes import run_reporting_errors
from kconvert.io.gc_pause import end_without_teardown

from . import export_cmd, fixture_cmd, inspect_cmd, pack_cmd, shard_cmd
from . import load_cmd, plan_cmd, serve_check_cmd, verify_cmd


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="kconvert")
def app() -> None:
    """kconvert: convert, reshard, quantize, load and verify DeepSeek-V3.2 / Kimi-K2.5-class checkpoints.

    \b
    Example (a generated test checkpoint, end to end):
      kconvert fixture tiny-k25-dsv32 ./tiny-k25-dsv32
      kconvert inspect ./tiny-k25-dsv32
    """


app.add_command(inspect_cmd.inspect)
app.add_command(plan_cmd.plan)
app.add_command(load_cmd.load)
app.add_command(verify_cmd.reference)
app.add_command(verify_cmd.verify)
app.add_command(fixture_cmd.fixture)
app.add_command(shard_cmd.shard)
app.add_command(shard_cmd.verify_files)
app.add_command(pack_cmd.pack)
app.add_command(pack_cmd.unpack)
app.add_command(export_cmd.export)
app.add_command(serve_check_cmd.serve_check)
# journalled commands (convert/run.Run): interrupted, the same command resumes from the files already written
RESUMABLE = (shard_cmd.shard, export_cmd.export, pack_cmd.pack, pack_cmd.unpack)


def main(argv: list[str] | None = None) -> int:
    def run() -> int:
        try:
            rv = app.main(args=argv, prog_name="kconvert", standalone_mode=False)
            return rv if type(rv) is int else 0  # click returns the code of a raised click.exceptions.Exit
        except click.ClickException as e:  # click's own usage errors
            e.show()
            return 2
        except click.exceptions.Exit as e:
            return e.exit_code

    args = sys.argv[1:] if argv is None else argv
    resumes = bool(args) and app.commands.get(args[0]) in RESUMABLE

    def say(line: str) -> None:
        if line == "interrupted" and resumes:
            line += ": run the same command again to resume (finished files are kept)"
        click.echo(f"kconvert: {line}", err=True)

    def peer(e: Exception) -> int | None:  # under torchrun: another worker died, this one is not at fault
        from kconvert.distributed import peer_gone

        line = peer_gone(e)
        if line is None:
            return None
        say(f"error: {line}")
        return 1

    return run_reporting_errors(run, say, interrupts=(KeyboardInterrupt, click.exceptions.Abort), on_internal=peer)


def entry() -> None:
    end_without_teardown()
    rc = main()
    # What the command built (a release's 100k+ header entries and plan outputs) is not torn down object by object
    # at exit (the collector's last pass over it, then every deallocation: ~0.1-0.4 s of CPU after a 200k-tensor
    # command): once the exit handlers have run and the output is flushed, the process ends. With another thread
    # still alive it exits the usual way, which waits for it.
    gc.freeze()
    if threading.active_count() == 1:
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe (`| head`): nothing more to say there
                pass
        os._exit(rc if isinstance(rc, int) else 1)
    sys.exit(rc)


if __name__ == "__main__":
    entry()
