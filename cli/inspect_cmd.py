"""`kconvert inspect SRC`: family, parameters by component, formats, bytes (headers only)."""

from __future__ import annotations

import json

import click
from rich.console import Console
from rich.table import Table

from .units import fmt_bytes, fmt_count


@click.command()
@click.argument("src")
@click.option("--revision", help="Hub revision (branch, tag or commit) when SRC is a repo id.")
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable JSON summary.")
def inspect(src: str, revision: str | None, as_json: bool) -> None:
    """Describe checkpoint SRC (a local directory or a Hub repo id) from its config and headers only.

    Validates every tensor against the family manifest (names, shapes, nothing missing) and
    counts parameters by component; no weights are read, so a 1 TB checkpoint takes seconds.

    \b
    Example:
      kconvert inspect ./tiny-k3
      kconvert inspect moonshotai/Kimi-K2.5 --json
    """
    from kconvert.plan.inspect import summarize
    from kconvert.source.checkpoint import Checkpoint

    s = summarize(Checkpoint.open(src, revision=revision, headers_only=True))
    if as_json:
        click.echo(json.dumps(s.to_json(), indent=2))
        return
    con = Console()
    con.print(f"[bold]{s.source}[/]  family [cyan]{s.family}[/] ({', '.join(s.architectures)})")
    m = s.model
    con.print(f"{m['layers']} layers ({m['dense_layers']} dense, {m['mtp_layers']} MTP), hidden {m['hidden_size']}, "
              f"{m['attention_heads']} heads, {m['routed_experts']} routed experts ({m['experts_per_token']} per token) "
              f"+ {m['shared_experts']} shared, vocab {m['vocab_size']}, DSA top-k {m['sparse_attention_topk']}, "
              f"vision layers {m['vision_layers']}")
    for kinds in (m.get("layer_kinds") or {}).values():
        con.print("layers by kind: " + ", ".join(f"{k} {n}" for k, n in kinds.items()))
    t = Table(title="Parameters by component")
    t.add_column("component")
    t.add_column("parameters", justify="right")
    t.add_column("share", justify="right")
    for comp, n in s.params.items():
        t.add_row(comp, fmt_count(n), f"{100 * n / max(s.total_params, 1):.1f} %")
    t.add_row("[bold]total[/]", f"[bold]{fmt_count(s.total_params)}[/]", "")
    t.add_row("active per token (text)", fmt_count(s.active_params), "")
    con.print(t)
    f = Table(title="Stored formats")
    for col in ("format", "dtype", "tensors", "parameters", "bytes"):
        f.add_column(col, justify="right" if col in ("tensors", "parameters", "bytes") else "left")
    for row in s.formats:
        f.add_row(row["format"], row["dtype"], str(row["tensors"]), fmt_count(row["params"]), fmt_bytes(row["bytes"]))
    con.print(f)
    con.print(f"{s.tensors} tensors in {s.files} files, {fmt_bytes(s.bytes_on_disk)} on disk")
