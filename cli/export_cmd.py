"""`kconvert export`: a Hugging Face-layout checkpoint that SGLang / vLLM load as it is."""

from __future__ import annotations

import click

from .calibrate_opts import calibration_factory, calibration_options
from .lazy import RegistryChoice, export_formats, scale_formats
from .progress import byte_progress
from .run_summary import io_facts, print_run
from .serve_check_cmd import check_and_report
from .units import parse_size
from .params import COUNT, Whole


@click.command()
@click.argument("src")
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--format", "fmt", type=RegistryChoice(export_formats), required=True,
              help="fp8-block: DeepSeek/Kimi FP8 release format; w4a16: compressed-tensors int4 routed experts; "
                   "w8a8-int8 / fp8-channel: compressed-tensors per-channel weights, dynamic per-token activations; "
                   "bf16: the release's layout unquantized, every quantized tensor dequantized; "
                   "nvfp4: NVIDIA's NVFP4 (ModelOpt layout; DeepSeek-V4's as NVIDIA's builds); nvfp4-ct: "
                   "compressed-tensors nvfp4-pack-quantized routed experts.")
@click.option("--group-size", type=Whole(8, 65536), default=32, show_default=True, help="w4a16: input columns per int4 scale.")
@click.option("--scale-format", type=RegistryChoice(scale_formats),
              help="fp8-block scales: float32 or powers of two (default: as a block-FP8 source stores them, else fp32).")
@click.option("--max-shard-size", default="5GB", show_default=True,
              help="Largest model-0000K-of-0000N.safetensors file.")
@click.option("--workers", type=COUNT,
              help="Tensors read and quantized in parallel (threads); default: cores + 1, fewer if memory is short.")
@click.option("--overwrite", is_flag=True, help="Replace a different (or unfinished) export in OUT.")
@calibration_options
@click.option("--check", type=click.Choice(["vllm"]),
              help="Then load OUT in vLLM's own model class and compare every weight as loaded (`kconvert serve-check`).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary.")
def export(src, out, fmt, group_size, scale_format, max_shard_size, workers, overwrite, calibrate_data, calibration_tokens,
           calibration_seq, calibration_seed, calibration_grid, check, as_json):
    """Write checkpoint SRC to OUT in Hugging Face layout and a quantized format serving engines load:
    published tensor names, model.safetensors.index.json, config.json with its quantization_config,
    tokenizer and side files. Streams with bounded memory; interrupted? re-run the same command to
    resume. The index is written last, so an unfinished OUT never looks like a checkpoint.

    \b
    Example:
      kconvert export ./tiny-k25-dsv32 ./tiny-k25-dsv32-w4a16 --format w4a16
      kconvert export ./tiny-k25-dsv32 ./tiny-k25-dsv32-gptq --format w4a16 --calibrate calib.jsonl   # GPTQ, layer by layer
      kconvert verify ./tiny-k25-dsv32-w4a16 --against ./tiny-k25-dsv32
    """
    from kconvert.convert.export.job import ExportJob, export as _export
    from kconvert.io.workdir import terminate_as_interrupt

    if check:  # no vLLM environment: one line before any work
        from kconvert.verify.vllm_check.env import vllm_python

        vllm_python()
    job = ExportJob(src, out, fmt, group_size, scale_format, parse_size(max_shard_size, "--max-shard-size"), workers, overwrite)
    # SIGTERM as Ctrl-C: the shard being written (.NAME.tmp-PID in OUT) is removed on the way out, not left
    with terminate_as_interrupt(), byte_progress(f"export {fmt}", enabled=not as_json) as cb:
        r = _export(job, progress=cb, calibrate=calibration_factory(
            calibrate_data, calibration_tokens, calibration_seq, calibration_seed, calibration_grid, ("minmax", "kimi"),
            out=out))
    d = r.details
    what = (f"{d.dequantized} dequantized to bf16, {d.rounded} of them rounded" if fmt == "bf16"
            else f"{d.quantized} quantized to {fmt}")
    if check and as_json:  # one JSON document: the export's summary beside the check
        code = check_and_report(out, None, None, True, extra={"export": r.to_json()})
    else:
        print_run(r, out, as_json, f"wrote {r.files_written} of {d.files} files ({r.files_resumed} resumed), "
                  f"{d.tensors} tensors ({what})", io_facts(r),
                  how=f" with {r.details.workers} workers")
        code = check_and_report(out, None, None, False) if check else 0
    if code:
        raise click.exceptions.Exit(code)
