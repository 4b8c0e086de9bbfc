"""`kconvert pack` and `kconvert unpack`: compress / decompress a converted directory in place."""

from __future__ import annotations

from pathlib import Path

import click

from .progress import byte_progress
from .run_summary import print_run, rate
from .units import fmt_bytes
from .params import RANK, Whole


def _report(r, out: str, as_json: bool) -> None:
    op = r.details.op
    ratio = f" (ratio {r.bytes_in / r.bytes_out if r.bytes_out else 0.0:.3f})" if op == "pack" else ""
    print_run(r, str(Path(out)), as_json,
              f"{op}ed {r.files_written} files ({r.files_resumed} resumed, {r.details.untouched} already {op}ed)",
              [f"{fmt_bytes(r.bytes_in)} plain", f"{fmt_bytes(r.bytes_out)} on disk now{ratio}", rate(r)],
              nothing=f"every file is already {'compressed' if op == 'pack' else 'plain'}")


@click.command()
@click.argument("out", type=click.Path(exists=True, file_okay=False))
@click.option("--compress", "codec", default="zstd", show_default=True, metavar="zstd[:LEVEL]",
              help="Codec and zstd level (1 is the default: on byte-grouped weights it measured best).")
@click.option("--threads", type=Whole(1, 1024), help="Chunks compressed in parallel (default: cores, at most 8).")
@click.option("--rank", "ranks", type=RANK, multiple=True,
              help="Only this rank's files (repeatable), reading only its tensor list: each node packs its own share.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary.")
def pack(out, codec, threads, ranks, as_json):
    """Compress every shard of converted checkpoint OUT in place (lossless zstd, byte-grouped).

    Streams file by file (temp + fsync + rename); interrupted? Re-run it: it resumes. The loader
    refuses the directory until it finishes. `kconvert unpack OUT` restores the exact bytes.

    \b
    Example:
      kconvert pack ./tiny-k25-dsv32-tp2                 # zstd level 1; --compress zstd:LEVEL for another
      kconvert pack ./tiny-k25-dsv32-tp2 --rank 1        # rank 1's files only (a node's own copy)
    """
    from kconvert.io.compressed import parse_codec
    from kconvert.convert.pack import pack as _pack

    _, level = parse_codec(codec)
    with byte_progress(f"pack zstd:{level}", enabled=not as_json) as cb:
        r = _pack(out, level=level, threads=threads, progress=cb, ranks=list(ranks) or None)
    _report(r, out, as_json)


@click.command()
@click.argument("out", type=click.Path(exists=True, file_okay=False))
@click.option("--threads", type=Whole(1, 1024), help="Chunks decompressed in parallel (default: cores, at most 8).")
@click.option("--rank", "ranks", type=RANK, multiple=True,
              help="Only this rank's files (repeatable), reading only its tensor list.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary.")
def unpack(out, threads, ranks, as_json):
    """Decompress every compressed shard of converted checkpoint OUT in place (byte-identical to before pack).

    \b
    Example:
      kconvert unpack ./tiny-k25-dsv32-tp2
      kconvert unpack ./tiny-k25-dsv32-tp2 --rank 1      # rank 1's files only
    """
    from kconvert.convert.pack import unpack as _unpack

    with byte_progress("unpack", enabled=not as_json) as cb:
        r = _unpack(out, threads=threads, progress=cb, ranks=list(ranks) or None)
    _report(r, out, as_json)
