"""`kconvert shard` and `kconvert verify-files`."""

from __future__ import annotations

import json
import os

import click
from rich.table import Table

from .calibrate_opts import calibration_factory, calibration_options
from .lazy import RegistryChoice, int4_scale_rules, scale_formats, shard_schemes
from .progress import byte_progress
from .run_summary import io_facts, print_run
from .units import fmt_bytes
from .params import COUNT, RANK, Whole


def _rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


@click.command()
@click.argument("src")
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--tp", type=COUNT, required=True, help="Tensor-parallel degree (number of ranks).")
@click.option("--ep", type=COUNT, help="Expert groups (default = tp: whole experts per rank; 1: split every expert).")
@click.option("--pp", type=COUNT, default=1, show_default=True,
              help="Pipeline stages: contiguous layers per stage, balanced by bytes per rank; tp x pp ranks in all.")
@click.option("--pp-layers", metavar="A-B,C-D,...",
              help="The decoder layers of each stage instead of the balanced split, e.g. 0-14,15-30,31-60.")
@click.option("--quant", type=RegistryChoice(shard_schemes), default="none", show_default=True,
              help="Target weight format for quantizable tensors.")
@click.option("--scale-format", type=RegistryChoice(scale_formats), default="fp32", show_default=True,
              help="FP8 block scales: float32, or powers of two (UE8M0) as DeepSeek-V3.1+ uses.")
@click.option("--group-size", type=Whole(2, 65536), default=32, show_default=True, help="int4: inputs per scale group.")
@click.option("--int4-scales", type=RegistryChoice(int4_scale_rules), default="mse", show_default=True,
              help="int4 scales: clipping search for the least squared error per group, or plain amax / 7.")
@click.option("--keep", multiple=True, metavar="PATTERN", help="Keep matching tensors in bf16 (glob, repeatable).")
@click.option("--quantize", "force", multiple=True, metavar="PATTERN",
              help="Quantize matching 2-D tensors even if the manifest keeps them (glob, repeatable).")
@click.option("--requantize", is_flag=True, help="Block-FP8 source cut inside a block: dequantize and re-quantize.")
@click.option("--draft-heads/--no-draft-heads", default=True, show_default=True,
              help="Convert the source's draft heads (MTP layers) for speculative decoding (engine.chat "
                   "--speculative); --no-draft-heads leaves them out.")
@click.option("--keep-mtp", is_flag=True, hidden=True,
              help="Accepted for old scripts: draft heads are converted by default now (see --no-draft-heads).")
@click.option("--workers", type=COUNT,
              help="Units converted in parallel (threads); default: cores + 1, fewer if memory is short.")
@click.option("--overwrite", is_flag=True, help="Replace a different (or unfinished) conversion in OUT.")
@click.option("--compress", metavar="zstd[:LEVEL]",
              help="Write compressed shards (lossless zstd, byte-grouped; the loader reads them transparently).")
@calibration_options
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary instead of tables.")
def shard(src, out, tp, ep, pp, pp_layers, quant, scale_format, group_size, int4_scales, keep, force, requantize, draft_heads,
          keep_mtp, workers,
          overwrite, compress, calibrate_data, calibration_tokens, calibration_seq, calibration_seed, calibration_grid,
          as_json):
    """Reshard checkpoint SRC for --tp ranks into OUT, quantizing to FP8, INT8, INT4, FP4 or NVFP4 on the way
    (int4: routed experts, symmetric, one scale per --group-size inputs, two values per byte; nvfp4: routed experts
    NVFP4, MXFP4 ones cast exactly, the family's other roles as NVIDIA's builds: block FP8 attention).

    Streams tensor by tensor with bounded memory; every file is written to a temporary name and
    renamed when complete. Interrupted? Re-run the same command: it resumes. kconvert.json is
    written last, so its presence means the conversion is complete. Under
    `torchrun --nproc-per-node K kconvert shard ...` K processes share the work.

    \b
    Example:
      kconvert shard ./tiny-k25-dsv32 ./tiny-k25-dsv32-tp2-fp8 --tp 2 --quant fp8
      kconvert shard ./tiny-k25-dsv32 ./tiny-k25-dsv32-tp2-int4 --tp 2 --quant int4 --group-size 32
      kconvert shard ./tiny-k25-dsv32 ./tiny-k25-dsv32-gptq --tp 2 --quant int4 --calibrate calib.jsonl   # GPTQ, layer by layer
      kconvert shard ./tiny-kimi-k3 ./tiny-kimi-k3-nvfp4 --tp 2 --quant nvfp4   # Blackwell: MXFP4 experts cast exactly
      kconvert shard ./tiny-k25-dsv32 ./tiny-k25-dsv32-tp2-z --tp 2 --compress zstd
      kconvert shard ./tiny-k25-dsv32 ./tiny-k25-dsv32-tp2-pp2 --tp 2 --pp 2          # 4 ranks: 2 stages of 2
      torchrun --nproc-per-node 4 -m cli.main shard SRC OUT --tp 8 --quant fp8
    """
    from kconvert.convert.shard.job import ShardJob, shard as _shard
    from kconvert.convert.layout import Topology
    from kconvert.quant.policy import QuantPolicy

    if keep_mtp and not draft_heads:
        from kconvert.errors import UsageError

        raise UsageError("--keep-mtp (kept for old scripts) and --no-draft-heads contradict each other")
    job = ShardJob(src, out, topology=Topology(tp=tp, ep=ep, pp=pp, pp_layers=pp_layers),
                   quant=QuantPolicy(scheme=quant, scale_format=scale_format, keep=tuple(keep), force=tuple(force),
                                     requantize=requantize, group_size=group_size, int4_scales=int4_scales),
                   keep_mtp=draft_heads, workers=workers, overwrite=overwrite, compress=compress)
    with byte_progress(f"shard tp={tp}" + (f" pp={pp}" if pp > 1 else "") + f" {quant}", enabled=not as_json and _rank0()) as cb:
        r = _shard(job, progress=cb, calibrate=calibration_factory(
            calibrate_data, calibration_tokens, calibration_seq, calibration_seed, calibration_grid, ("kconvert", "kimi"),
            out=out))
    if not _rank0():
        return
    table = Table(title="bytes per rank")
    table.add_column("rank", justify="right")
    table.add_column("bytes", justify="right")
    for rank, n in sorted(r.details.per_rank_bytes.items()):
        table.add_row(str(rank), fmt_bytes(n))
    facts = io_facts(r) + cast_facts(r.details.exact_casts)
    print_run(r, out, as_json, f"wrote {r.files_written} files ({r.files_resumed} resumed)", facts, table=table,
              how=f" by {r.details.processes} processes together" if (r.details.processes or 1) > 1 else "")


def cast_facts(casts: dict | None) -> list[str]:
    """One fact per tensor kind an exact cast (nvfp4 from MXFP4) touched: its blocks kept exactly and those that
    needed a data-derived scale."""
    return [f"{kind}: {c['exact']} of {c['exact'] + c['data_derived']} blocks cast exactly"
            + (f", {c['data_derived']} data-derived (lossy)" if c["data_derived"] else "")
            for kind, c in (casts or {}).items()]


@click.command("verify-files")
@click.argument("out", type=click.Path(exists=True, file_okay=False))
@click.option("--rank", "ranks", type=RANK, multiple=True,
              help="Only this rank's files (repeatable), reading only its tensor list: each node checks its own share.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON result.")
def verify_files(out, ranks, as_json):
    """Recompute the checksum of every file of converted checkpoint OUT against kconvert.json.

    Exits 2 naming the first damaged file and the first damaged tensor in it.

    \b
    Example:
      kconvert verify-files ./tiny-k25-dsv32-tp2-fp8
      kconvert verify-files ./tiny-k25-dsv32-tp2-fp8 --rank 1    # one rank's files (a node's own)
    """
    from kconvert.disk_format.integrity import verify_files as _verify_files

    with byte_progress("verify", enabled=not as_json) as cb:
        r = _verify_files(out, progress=lambda n: cb("advance", n=n), ranks=list(ranks) or None)
    if as_json:
        click.echo(json.dumps({"ok": True, **r}))
    else:
        click.echo(f"{out}: {r['files']} files, {fmt_bytes(r['bytes'])}: all checksums match")
