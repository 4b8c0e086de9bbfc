"""`kconvert export`: a Hugging Face-layout checkpoint that SGLang / vLLM load as it is."""

from __future__ import annotations

import json

import click
from rich.console import Console

from kconvert.convert.export import DEFAULT_MAX_SHARD, ExportJob, export as _export
from kconvert.convert.export_formats import FORMATS

from .progress import byte_progress
from .units import fmt_bytes, parse_size


@click.command()
@click.argument("src")
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--format", "fmt", type=click.Choice(FORMATS), required=True,
              help="fp8-block: DeepSeek/Kimi FP8 release format; w4a16: compressed-tensors int4 routed experts; "
                   "w8a8-int8 / fp8-channel: compressed-tensors per-channel weights, dynamic per-token activations.")
@click.option("--group-size", type=int, default=32, show_default=True, help="w4a16: input columns per int4 scale.")
@click.option("--scale-format", type=click.Choice(["fp32", "ue8m0"]),
              help="fp8-block scales: float32 or powers of two (default: as a block-FP8 source stores them, else fp32).")
@click.option("--max-shard-size", default=f"{DEFAULT_MAX_SHARD // 10**9}GB", show_default=True,
              help="Largest model-0000K-of-0000N.safetensors file.")
@click.option("--workers", type=click.IntRange(min=1),
              help="Tensors read and quantized in parallel (threads); default: cores + 1, fewer if memory is short.")
@click.option("--overwrite", is_flag=True, help="Replace a different (or unfinished) export in OUT.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary.")
def export(src, out, fmt, group_size, scale_format, max_shard_size, workers, overwrite, as_json):
    """Write checkpoint SRC to OUT in Hugging Face layout and a quantized format serving engines load:
    published tensor names, model.safetensors.index.json, config.json with its quantization_config,
    tokenizer and side files. Streams with bounded memory; interrupted? re-run the same command to
    resume. The index is written last, so an unfinished OUT never looks like a checkpoint.

    \b
    Example:
      kconvert export ./tiny-k3 ./tiny-k3-w4a16 --format w4a16
      kconvert verify ./tiny-k3-w4a16 --against ./tiny-k3
    """
    job = ExportJob(src, out, fmt, group_size, scale_format, parse_size(max_shard_size), workers, overwrite)
    with byte_progress(f"export {fmt}", enabled=not as_json) as cb:
        r = _export(job, progress=cb)
    if as_json:
        click.echo(json.dumps(r.to_json(), indent=2))
        return
    con = Console()
    if r.already_complete:
        con.print(f"{out}: already complete for these arguments (nothing to do)")
        return
    rate = r.bytes_in / r.seconds / 1e9 if r.seconds else 0
    con.print(f"wrote {r.files_written} of {r.files} files ({r.files_resumed} resumed), {r.tensors} tensors "
              f"({r.quantized} quantized to {fmt}) in {r.seconds:.1f} s with {r.workers} workers: "
              f"{fmt_bytes(r.bytes_in)} read, {fmt_bytes(r.bytes_out)} written, {rate:.2f} GB/s, "
              f"peak RSS {fmt_bytes(r.peak_rss_bytes)}")
