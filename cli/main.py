"""Entry point: the click group, and the one place that turns errors into exit codes.

Exit codes: 0 success, 1 a check that ran and failed (verify), 2 bad input (one line, no traceback),
130 interrupted. Set KCONVERT_DEBUG=1 to see tracebacks of unexpected errors.
"""

from __future__ import annotations

import os
import sys

import click

from kconvert import __version__
from kconvert.errors import KConvertError

from . import export_cmd, fixture_cmd, inspect_cmd, pack_cmd, shard_cmd
from . import load_cmd, plan_cmd, verify_cmd


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="kconvert")
def app() -> None:
    """kconvert: convert, reshard, quantize, load and verify DeepSeek-V3.2 / Kimi-K2.5-class checkpoints.

    \b
    Example (a generated test checkpoint, end to end):
      kconvert fixture tiny-k3 ./tiny-k3
      kconvert inspect ./tiny-k3
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


def main(argv: list[str] | None = None) -> int:
    try:
        rv = app.main(args=argv, prog_name="kconvert", standalone_mode=False)
        return rv if type(rv) is int else 0  # click returns the code of a raised click.exceptions.Exit
    except KConvertError as e:
        click.echo(f"kconvert: error: {e.one_line()}", err=True)
        return e.exit_code
    except click.exceptions.Abort:
        click.echo("kconvert: interrupted", err=True)
        return 130
    except click.ClickException as e:
        e.show()
        return 2
    except click.exceptions.Exit as e:
        return e.exit_code
    except KeyboardInterrupt:
        click.echo("kconvert: interrupted", err=True)
        return 130
    except ModuleNotFoundError as e:  # an optional package (the `ref` extra, matplotlib...) is not installed
        from kconvert.deps import from_import_error

        dep = from_import_error(e)
        if dep is None:
            return _internal(e)
        click.echo(f"kconvert: error: {dep.one_line()}", err=True)
        return dep.exit_code
    except Exception as e:
        return _internal(e)


def _internal(e: Exception) -> int:
    """A bug of ours: still one line, with a way to get the traceback."""
    if os.environ.get("KCONVERT_DEBUG"):
        raise e
    click.echo(f"kconvert: internal error: {e.__class__.__name__}: {e} (set KCONVERT_DEBUG=1 for a traceback)", err=True)
    return 3


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
