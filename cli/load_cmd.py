"""`kconvert load OUT`: stream one rank onto a device and report time-to-ready by phase."""

from __future__ import annotations

import json

import click
from rich.console import Console
from rich.table import Table

from kconvert.kv_rows import KV_DTYPES

from .lazy import RegistryHelpOption, device_help
from .progress import byte_progress
from .units import fmt_bytes
from .params import COUNT, RANK, Whole


@click.command()
@click.argument("out", type=click.Path(exists=True, file_okay=False))
@click.option("--rank", type=RANK, help="Which rank to load: the global rank, stage x tp + tp rank (default 0).")
@click.option("--stage", type=RANK, help="Pipeline stage to load (with --tp-rank; a tp x pp conversion).")
@click.option("--tp-rank", type=RANK, help="Tensor-parallel rank within --stage.")
@click.option("--world-size", type=COUNT, help="Check the conversion was made for this many ranks (tp x pp).")
@click.option("--device", default="auto", show_default=True, cls=RegistryHelpOption, help_from=device_help)
@click.option("--verify/--no-verify", default=False, show_default=True,
              help="Check each file's CRC-32 against kconvert.json before its tensors are used.")
@click.option("--prefetch", type=Whole(0, 1024), default=2, show_default=True, help="Units read ahead of the consumer.")
@click.option("--threads", type=Whole(1, 1024), default=4, show_default=True, help="Reader threads per file.")
@click.option("--warmup", type=Whole(0, 10**6), default=0, show_default=True,
              help="Build our engine from the streamed units and run N warmup forward passes. On a tp-N "
                   "conversion without --rank this starts all N ranks itself (or runs under torchrun).")
@click.option("--kv-dtype", type=click.Choice(KV_DTYPES), help="KV cache format of the --warmup passes.")
@click.option("--kv-budget", help="Bytes the --warmup KV cache may take (8GiB) or a fraction of free memory.")
@click.option("--kv-device-budget", help="Bytes of KV latent on the device; older pages go to host memory.")
@click.option("--json", "as_json", is_flag=True, help="Print the phase table as JSON.")
def load(out, rank, stage, tp_rank, world_size, device, verify, prefetch, threads, warmup, kv_dtype, kv_budget, kv_device_budget,
         as_json):
    """Load rank RANK of converted checkpoint OUT onto DEVICE, layer by layer, and time it. On a tp x pp
    conversion a rank holds only its stage's units; name it globally (--rank) or by --stage and --tp-rank.

    Prints the phases (open, read, verify, copy), bytes/s and peak host/device memory.

    \b
    Example:
      kconvert load ./tiny-k25-dsv32-tp2-fp8 --rank 1 --device cpu --verify
      kconvert load ./tiny-k25-dsv32-tp2-pp2 --stage 1 --tp-rank 0 --device cpu   # = --rank 2
      kconvert load ./tiny-k25-dsv32-tp2-fp8 --warmup 2      # every rank, rank 0 reports
      kconvert load ./tiny-k25-dsv32-tp2-fp8 --warmup 2 --kv-dtype fp8 --kv-budget 1GiB
    """
    if warmup and _launched_ranks(out, device):
        return
    import os

    from engine.runtime.time_to_ready import load_rank

    rank0 = os.environ.get("RANK", "0") == "0"
    with byte_progress("load", enabled=not as_json and rank0, speed=False) as cb:  # one rate: the summary's
        report = load_rank(out, rank=rank, stage=stage, tp_rank=tp_rank, world_size=world_size, device=device,
                           verify=verify, prefetch=prefetch, threads=threads, warmup=warmup, kv_dtype=kv_dtype,
                           kv_budget=kv_budget, kv_device_budget=kv_device_budget, progress=cb)
    if not rank0:
        return
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    _print_table(report, warmup)


def _print_table(report: dict, warmup: int) -> None:
    where = f" (stage {report['stage']}, tp rank {report['tp_rank']})" if report["pp"] > 1 else ""
    click.echo(f"rank {report['rank']} of {report['world_size']}{where} → {report['device']}: {report['files']} files, "
               f"{fmt_bytes(report['bytes'])}, {report['tensors']} tensors")
    t = Table()
    t.add_column("phase")
    t.add_column("seconds", justify="right")
    for phase in ("start_ranks", "open", "read", "verify", "copy", "load", "warmup", "ready"):
        if (phase == "verify" and not report["verified"]) or (phase == "copy" and report["device"] == "cpu") \
                or (phase in ("warmup", "start_ranks") and not warmup):
            continue
        t.add_row(phase.replace("_", " "), f"{report['seconds'][phase]:.3f}")
    Console().print(t)
    dev_peak = report["peak_device_bytes"]
    click.echo(f"load: {report['GBps']:.2f} GB/s (this rank's bytes / the load phase), peak host RSS "
               f"{fmt_bytes(report['peak_host_rss_bytes'])}" + (f", peak device {fmt_bytes(dev_peak)}" if dev_peak is not None else ""))
    if report.get("kv"):
        kv = report["kv"]
        click.echo(f"KV cache: {kv['dtype'] or 'compute dtype'}, budget {kv['budget'] or 'unbounded'}, device budget "
                   f"{kv['device_budget'] or 'none (no host tier)'}")


def _launched_ranks(out, device) -> bool:
    """--warmup runs the model, so on a tp-N conversion without --rank (and not under torchrun) start the
    N ranks here (engine.runtime.launch): this process becomes rank 0 and runs this command again as that rank."""
    from engine.runtime import launch
    from kconvert.errors import UsageError
    from kconvert import devices
    from kconvert.load.loader import open_converted

    ctx = click.get_current_context()
    if launch.under_launcher():
        return False
    conv = open_converted(out)
    tp = conv.world_size  # every rank of every stage
    if tp == 1:
        return False
    if any(ctx.params[k] is not None for k in ("rank", "stage", "tp_rank")):
        raise UsageError(f"--warmup runs the model, which needs all {tp} ranks: drop --rank and they start here "
                         "(or run every rank under torchrun)", file=str(out))
    dev = str(devices.resolve(device))
    world = launch.world_for(conv, None, dev)
    body = lambda: ctx.invoke(load, **ctx.params) or 0  # noqa: E731 (this command again, as rank 0)
    rc = launch.run(world, _argv(ctx.params), body, dev, prefix="kconvert: error")
    if rc:
        raise click.exceptions.Exit(rc)
    return True


def _argv(params: dict) -> list[str]:
    """This command's options, written out again for the other ranks."""
    import sys

    args = [str(params["out"])]
    for name in ("world_size", "device", "prefetch", "threads", "warmup", "kv_dtype", "kv_budget", "kv_device_budget"):
        if params[name] is not None:
            args += [f"--{name.replace('_', '-')}", str(params[name])]
    args += ["--verify"] if params["verify"] else []
    args += ["--json"] if params["as_json"] else []
    return [sys.executable, "-m", "cli.main", "load", *args]
