"""What a journalled run (`shard`, `export`, `pack`, `unpack`) prints when it ends: its JSON summary,
or one line (what it did, the time, then the facts) and, for some, a table."""

from __future__ import annotations

import json

import click
from rich.console import Console
from rich.table import Table

from .units import fmt_bytes


def print_run(r, out: str, as_json: bool, did: str, facts: list[str], *, how: str = "", table: Table | None = None,
              nothing: str = "already complete for these arguments") -> None:
    """`r` is a kconvert.convert.run.RunResult; `out` the directory as the user named it. Its warnings go to stderr,
    one line each, whatever the output."""
    for w in r.warnings:
        click.echo(f"kconvert: warning: {w}", err=True)
    if as_json:
        click.echo(json.dumps(r.to_json(), indent=2))
        return
    con = Console()
    if r.already_complete:
        con.print(f"{out}: {nothing} (nothing to do)", soft_wrap=True, markup=False)
        return
    con.print(f"{did} in {r.seconds:.1f} s{how}: " + ", ".join(facts), soft_wrap=True, markup=False)
    if table is not None:
        con.print(table)


def rate(r) -> str:
    return f"{r.bytes_in / r.seconds / 1e9 if r.seconds else 0:.2f} GB/s"


def io_facts(r) -> list[str]:
    """Bytes read and written, the rate, the peak memory."""
    return [f"{fmt_bytes(r.bytes_in)} read", f"{fmt_bytes(r.bytes_out)} written", rate(r),
            f"peak RSS {fmt_bytes(r.peak_rss_bytes)}"]
