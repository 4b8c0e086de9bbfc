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
    counts parameters by component; no weights are read, so a 1 TB checkpoint takes seconds. An export
    (or a quantized release) also shows its format and scheme. A converted directory (`kconvert shard`
    output) shows its family, tp x pp, scheme, bytes per rank and whether it is compressed.

    \b
    Example:
      kconvert inspect ./tiny-k25-dsv32
      kconvert inspect moonshotai/Kimi-K2.5 --json
      kconvert inspect ./tiny-k25-dsv32-tp2-fp8
    """
    from kconvert.io.gc_pause import keep_to_exit, paused_gc
    from kconvert.inspect.checkpoint import summarize
    from kconvert.inspect.converted import is_converted, summarize_converted
    from kconvert.source.checkpoint import Checkpoint

    if is_converted(src):
        _print_converted(summarize_converted(src), as_json)
        return
    with paused_gc():  # 100k+ header entries, none in a cycle: the collector would only walk them again and again
        ck = Checkpoint.open(src, revision=revision, headers_only=True)
        s = summarize(ck)
        keep_to_exit(ck)  # not freed object by object when this returns (500k+ entries at a release's size)
    for w in s.warnings:
        click.echo(f"kconvert: warning: {w}", err=True)
    if as_json:
        click.echo(json.dumps(s.to_json(), indent=2))
        return
    con = Console()
    con.print(f"[bold]{s.source}[/]  family [cyan]{s.family}[/] ({', '.join(s.architectures)})")
    if s.variant:
        con.print(f"release: [cyan]{s.variant['name']}[/] ({s.variant['release']}): {s.variant['differs']}")
    if s.quantization:
        con.print(f"quantized: format [cyan]{s.quantization['format']}[/] (scheme {s.quantization['scheme']})")
    m = s.model
    bank = f": {m['draft_experts'][0]} routed experts, {m['draft_experts'][1]} per token" if m.get("draft_experts") else ""
    con.print(f"{m['layers']} layers ({m['dense_layers']} dense, {m['mtp_layers']} MTP{bank}), hidden {m['hidden_size']}, "
              f"{m['attention_heads']} heads, {m['routed_experts']} routed experts ({m['experts_per_token']} per token) "
              f"+ {m['shared_experts']} shared, vocab {m['vocab_size']}"
              + (f", indexer top-k {m['sparse_attention_topk']}" if m['sparse_attention_topk'] else "")
              + f", vision layers {m['vision_layers']}")
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


def _print_converted(c, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(c.to_json(), indent=2))
        return
    con = Console()
    q = c.quantization
    opts = ", ".join(f"{k} {v}" for k, v in q.items() if k != "scheme" and v not in (None, [], False))
    con.print(f"[bold]{c.path}[/]  converted, family [cyan]{c.family}[/]; tp {c.tp} x pp {c.pp} = {c.ranks} ranks "
              f"(ep {c.ep}); scheme [cyan]{c.scheme}[/]" + (f" ({opts})" if opts else ""))
    con.print(f"{c.tensors} tensors in {c.files} files, {fmt_bytes(c.bytes_on_disk)} on disk, compressed: {c.compressed}; "
              f"from {c.source['path']} (fingerprint {c.source['fingerprint']})")
    t = Table(title="on disk per rank")
    t.add_column("rank", justify="right")
    t.add_column("bytes", justify="right")
    for rank, n in c.bytes_per_rank.items():
        t.add_row(str(rank), fmt_bytes(n))
    con.print(t)
