"""`kconvert pack` and `kconvert unpack`: compress / decompress a converted directory in place."""

from __future__ import annotations

import json

import click

from .progress import byte_progress
from .units import fmt_bytes


def _report(r, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(r.to_json(), indent=2))
        return
    if not r.files and not r.resumed:
        click.echo(f"{r.out}: every file is already {'compressed' if r.op == 'pack' else 'plain'} (nothing to do)")
        return
    ratio = r.plain_bytes / r.stored_bytes if r.stored_bytes else 0.0
    rate = r.plain_bytes / r.seconds / 1e9 if r.seconds else 0.0
    click.echo(f"{r.op}ed {r.files} files ({r.resumed} resumed, {r.untouched} already {r.op}ed) in {r.seconds:.1f} s: "
               f"{fmt_bytes(r.plain_bytes)} plain, {fmt_bytes(r.stored_bytes)} on disk now"
               + (f" (ratio {ratio:.3f})" if r.op == "pack" else "") + f", {rate:.2f} GB/s")


@click.command()
@click.argument("out", type=click.Path(exists=True, file_okay=False))
@click.option("--compress", "codec", default="zstd", show_default=True, metavar="zstd[:LEVEL]",
              help="Codec and zstd level (1 is the default: on byte-grouped weights it measured best).")
@click.option("--threads", type=int, help="Chunks compressed in parallel (default: cores, at most 8).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary.")
def pack(out, codec, threads, as_json):
    """Compress every shard of converted checkpoint OUT in place (lossless zstd, byte-grouped).

    Streams file by file (temp + fsync + rename); interrupted? Re-run it: it resumes. The loader
    refuses the directory until it finishes. `kconvert unpack OUT` restores the exact bytes.

    \b
    Example:
      kconvert pack ./tiny-k3-tp2 --compress zstd:3
    """
    from kconvert.io.compressed import parse_codec
    from kconvert.convert.pack import pack as _pack

    _, level = parse_codec(codec)
    with byte_progress(f"pack zstd:{level}", enabled=not as_json) as cb:
        r = _pack(out, level=level, threads=threads, progress=cb)
    _report(r, as_json)


@click.command()
@click.argument("out", type=click.Path(exists=True, file_okay=False))
@click.option("--threads", type=int, help="Chunks decompressed in parallel (default: cores, at most 8).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary.")
def unpack(out, threads, as_json):
    """Decompress every compressed shard of converted checkpoint OUT in place (byte-identical to before pack).

    \b
    Example:
      kconvert unpack ./tiny-k3-tp2
    """
    from kconvert.convert.pack import unpack as _unpack

    with byte_progress("unpack", enabled=not as_json) as cb:
        r = _unpack(out, threads=threads, progress=cb)
    _report(r, as_json)
