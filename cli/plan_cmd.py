"""`kconvert plan SRC --tp N --quant fp8`: bytes per rank, KV cache, and whether it fits a device."""

from __future__ import annotations

import json
import re
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from kconvert.errors import ManifestError, UsageError
from kconvert.plan.device_presets import GIB, devices
from kconvert.kv_rows import KV_DTYPES

from .lazy import RegistryChoice, shard_schemes
from .units import fmt_count
from .params import COUNT, Real

_TOKEN_UNITS = {"": 1, "K": 1024, "M": 1024**2}


MAX_CONTEXT = 1 << 30  # --context: past any model's max_position_embeddings (limits.toml: at most 2^26) by 16x


def parse_tokens(text: str) -> int:
    """'1M' -> 1048576, '128k' -> 131072, '4096' -> 4096, '1.5M' -> 1572864 (k = 1024, M = 1024**2)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmM]?)\s*", str(text), re.ASCII)  # no Unicode digits
    if not m or len(m.group(1)) > 18:
        raise UsageError(f"cannot read token count {text!r} (examples: 4096, 128k, 1M)")
    n = int(float(m.group(1)) * _TOKEN_UNITS[m.group(2).upper()])
    if n < 1:
        raise UsageError(f"token count {text!r} must be at least 1")
    if n > MAX_CONTEXT:
        raise UsageError(f"token count {text!r} is past {fmt_tokens(MAX_CONTEXT)} tokens: 16 times the largest "
                         "max_position_embeddings a config may declare (manifests/limits.toml)")
    return n


def fmt_tokens(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, div in (("M", 1024**2), ("K", 1024)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return f"{n:,}"


def gib(n: int | None) -> str:
    """Binary units (device memory is sold in them): 359.5 GiB, 12.0 MiB, 512 B."""
    if n is None:
        return "-"
    for unit, div in (("TiB", 2**40), ("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= div or (unit == "GiB" and abs(n) >= 0.1 * GIB):
            return f"{n / div:,.1f} {unit}"
    return f"{n} B"


def _room(n: int | None) -> str:
    if n is None:
        return "-"
    return f"[green]+{gib(n)}[/]" if n >= 0 else f"[red]-{gib(-n)}[/]"


def _device_names() -> str:
    """The presets' names for --help, read from the registry the planner uses (a broken file: say where)."""
    try:
        return ", ".join(devices())
    except ManifestError:
        return "see the file"


def _tries(p) -> str:
    tries = ["--kv-cache-dtype fp8"] if p.kv_cache["dtype"] != "fp8" else []
    tries += ["a shorter --context"] + (["a smaller --batch"] if p.memory["batch"] > 1 else [])
    tries += ["--quant fp8"] if p.quant == "none" else []
    return ", ".join(tries) + " or a bigger device"


@click.command()
@click.argument("src")
@click.option("--tp", type=COUNT, required=True, help="Tensor-parallel degree (ranks).")
@click.option("--ep", type=COUNT, help="Expert groups (default: = tp, whole experts per rank; 1: every expert split).")
@click.option("--pp", type=COUNT, default=1, show_default=True,
              help="Pipeline stages (layers split as `shard --pp` splits them; KV per stage: its layers only).")
@click.option("--pp-layers", metavar="A-B,C-D,...", help="Decoder layers of each stage instead of the balanced split.")
@click.option("--gpus-per-node", type=COUNT, default=8, show_default=True,
              help="Devices per node, for the node count of a tp x pp layout.")
@click.option("--quant", type=RegistryChoice(shard_schemes, check=False), default="none", show_default=True,
              help="Weight scheme after conversion (as `shard --quant`), or auto: the source's own format where "
                   "--device runs it, else the device's best (FP4 experts become fp8 on GPUs without FP4).")
@click.option("--device", default="H200", show_default=True, help=f"Device preset (manifests/devices.toml): {_device_names()}.")
@click.option("--context", "context_text", help="Tokens per sequence, e.g. 4096, 128k, 1M (k = 1024). "
              "Default: the model's max_position_embeddings.")
@click.option("--batch", type=COUNT, default=1, show_default=True, help="Sequences held in the KV cache at once.")
@click.option("--kv-cache-dtype", "--kv-dtype", "kv_dtype", type=RegistryChoice(lambda: KV_DTYPES, check=False), default="bf16",
              show_default=True, help="KV cache format (as engine.chat --kv-dtype; docs/KV_CACHE.md gives the bytes).")
@click.option("--reserve-gb", type=Real(0, 2**20), help="Activation/workspace reserve per rank in GiB "
              "(default: 2 GiB + 8192 tokens x hidden x 2 B x 24 buffers).")
@click.option("--mem-fraction", type=Real(0, 1, lo_open=True), default=0.92, show_default=True,
              help="Share of device memory the engine may use.")
@click.option("--host-gb", type=Real(0, 2**20), default=256.0, show_default=True,
              help="Host memory per rank for the KV host tier (the 'with host tier' context).")
@click.option("--revision", help="Hub revision when SRC is a repo id.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
def plan(src: str, tp: int, ep: int | None, pp: int, pp_layers: str | None, gpus_per_node: int, quant: str, device: str, context_text: str | None, batch: int,
         kv_dtype: str, reserve_gb: float | None, mem_fraction: float, host_gb: float, revision: str | None,
         as_json: bool) -> None:
    """Plan a conversion of SRC: weights per rank by component, KV cache per token, and whether it fits.

    Reads config.json and safetensors headers only. SRC is a checkpoint directory or Hub repo id, or a
    config.json alone (its directory, the file, or a bundled example name such as k25-dsv32-3t, a
    hypothetical ~3T-parameter Kimi-K2.5 over DeepSeek-V3.2 config).

    \b
    Example:
      kconvert plan k25-dsv32-3t --tp 8 --quant fp8 --device H200 --context 1M
      kconvert plan k25-dsv32-3t --tp 8 --pp 3 --quant fp8 --device H200 --context 128k
      kconvert plan ./tiny-k25-dsv32 --tp 4 --quant fp8 --kv-cache-dtype fp8 --json
    """
    from kconvert import renamed
    from kconvert.io.gc_pause import paused_gc
    from kconvert.plan.memory import make_plan

    if not Path(src).exists() and renamed.note(renamed.EXAMPLES, src, "example config"):
        click.echo(renamed.note(renamed.EXAMPLES, src, "example config"), err=True)
        src = renamed.current(renamed.EXAMPLES, src)
    context = parse_tokens(context_text) if context_text is not None else None
    with paused_gc():  # 100k+ header entries, none in a cycle: the collector would only walk them again and again
        p = make_plan(src, tp, ep, quant, device, context, batch, kv_dtype, reserve_gb, mem_fraction, revision, host_gb,
                      pp=pp, pp_layers=pp_layers, gpus_per_node=gpus_per_node)
    if as_json:
        click.echo(json.dumps(p.to_json(), indent=2))
        return
    con = Console()
    m, lay, mem = p.model, p.layout, p.memory
    kind = "checkpoint headers" if p.source_kind == "checkpoint" else "config only: manifest shapes, bf16 source"
    con.print(f"[bold]{p.source}[/] ({kind})  family [cyan]{p.family}[/]")
    drafts = f" (+ {fmt_count(p.params['mtp'])} in draft heads, converted with them)" if p.params.get("mtp") else ""
    con.print(f"{fmt_count(p.total_params)} parameters without MTP{drafts}; {m['layers']} layers, hidden {m['hidden_size']}, "
              f"{m['attention_heads']} heads, {m['routed_experts']} routed experts ({m['experts_per_token']} per token)")
    per = m["routed_experts"] // lay["ep"] if m["routed_experts"] else 0
    per = (f"{per} whole experts per rank" if lay["expert_tp"] == 1 else
           f"{per} experts per group of {lay['expert_tp']} ranks, each split {lay['expert_tp']} ways") if per else "no experts"
    con.print(f"layout tp {lay['tp']}, ep {lay['ep']} ({per}); "
              f"--quant {p.quant}: {gib(p.converted_bytes)} converted in all"
              + (f" (auto: {p.quant_reason})" if p.quant_reason else ""))

    whole = ", all stages together; per stage below" if p.pipeline else ""
    t = Table(title=f"Weights on tp rank {p.rank['index']} (the largest of {lay['tp']}{whole})")
    for col in ("component", "bytes", "share"):
        t.add_column(col, justify="left" if col == "component" else "right")
    for comp, n in p.rank["bytes"].items():
        t.add_row(comp, gib(n), f"{100 * n / max(p.rank['total'], 1):.1f} %")
    t.add_row("[bold]total[/]", f"[bold]{gib(p.rank['total'])}[/]", "")
    con.print(t)

    if p.pipeline:
        _stage_table(con, p.pipeline)
    kv = p.kv_cache
    latent = "MLA latent" if kv.get("cache", "mla") == "mla" else "compressed K=V entries, layer average"
    if kv.get("cache") == "hybrid":
        con.print(f"KV cache ({kv['dtype']}) per rank: {kv['mla_layers']} MLA layers keep "
                  f"{kv['mla_bytes_per_token']:,} B per token (replicated on every tp rank); {kv['kda_layers']} KDA layers "
                  f"keep {kv['kda_bytes_per_sequence']:,} B per sequence whatever its length (float32 state + conv window, "
                  "this rank's heads)" + ("; a pipeline stage keeps only its own layers'" if p.pipeline else ""))
    else:
        con.print(f"KV cache ({kv['dtype']}) per token per rank: {kv['layers']} layers x ({kv['latent_bytes']} B {latent} "
                  f"+ {kv['indexer_bytes']} B indexer key) = {kv['bytes_per_token']:,} B; replicated on every tp rank "
                  "(the latent has no heads to split)" + ("; a pipeline stage keeps only its own layers'" if p.pipeline else "")
                  + (f"; plus {kv['bytes_per_sequence']:,} B per sequence (sliding windows, compressor state)"
                     if kv.get("bytes_per_sequence") else ""))
    ctx = f"{fmt_tokens(mem['context'])} tokens x batch {mem['batch']}"
    con.print(f"{mem['device_name']}: {gib(mem['device_bytes'])} x {mem['mem_fraction']} = {gib(mem['usable_bytes'])} "
              f"usable; weights {gib(mem['weights_bytes'])} + reserve {gib(mem['reserve_bytes'])}"
              f"{'' if mem['reserve_default'] else ' (--reserve-gb)'} + KV {gib(mem['kv_bytes'])} at {ctx}")
    verdict = "[green]fits[/]" if mem["fits"] else "[red]does not fit[/]"
    at = f" (stage {mem['stage']}, the least headroom)" if p.pipeline else ""
    if mem["weights_bytes"] + mem["reserve_bytes"] > mem["usable_bytes"]:
        con.print(f"verdict{at}: {verdict} ({_room(mem['headroom_bytes'])} headroom): weights + reserve alone exceed "
                  "the usable memory, at any context")
    else:
        top = " (the model's max_position_embeddings)" \
            if mem["max_context"] and mem["max_context"] == p.model["max_position_embeddings"] else ""
        con.print(f"verdict{at}: {verdict} ({_room(mem['headroom_bytes'])} headroom); largest context that fits at "
                  f"batch {mem['batch']}: {fmt_tokens(mem['max_context'])} tokens{top}")
    smallest = next((r["tp"] for r in p.tp_table if r["fits"]), None)
    if not mem["fits"]:
        con.print(f"smallest tp that fits on {mem['device']} at {ctx}: "
                  + (str(smallest) if smallest else "none of " + ", ".join(str(r["tp"]) for r in p.tp_table if r["ok"])
                     + f" (try {_tries(p)})"))

    k = Table(title=f"KV options on {mem['device']} (batch {mem['batch']}; host tier: {gib(p.kv_options[0]['host_bytes'])} "
                    "host memory per rank)")
    for col in ("--kv-dtype", "latent B/token", "indexer B/token", "total B/token", "max context",
                "with host tier"):
        k.add_column(col, justify="left" if col == "--kv-dtype" else "right")
    for o in p.kv_options:
        k.add_row(o["dtype"], f"{o['latent_bytes_per_token']:,}", f"{o['indexer_bytes_per_token']:,}",
                  f"{o['bytes_per_token']:,}", fmt_tokens(o["max_context"]), fmt_tokens(o["tiered_max_context"]))
    con.print(k)

    stages = f" x pp {p.pipeline['pp']}" if p.pipeline else ""
    d = Table(title=f"Devices (tp {lay['tp']}{stages}, {ctx})")
    for col in ("device", "memory", "usable", "fp8", "fits", "headroom", "max context"):
        d.add_column(col, justify="left" if col == "device" else "right")
    for r in p.devices:
        d.add_row(f"{r['device']} ({r['backend']})", gib(r["device_bytes"]), gib(r["usable_bytes"]),
                  "yes" if r["fp8"] else "no",
                  "[green]yes[/]" if r["fits"] else "[red]no[/]", _room(r["headroom_bytes"]), fmt_tokens(r["max_context"]))
    con.print(d)

    tt = Table(title=f"tp degrees on {mem['device']} ({ctx})")
    for col in ("tp", "ep", "weights/rank", "fits", "headroom", "max context"):
        tt.add_column(col, justify="right")
    unaligned = False
    for r in p.tp_table:
        if not r["ok"]:
            tt.add_row(str(r["tp"]), str(r["ep"]), f"[dim]{r['reason']}[/]", "-", "-", "-")
            continue
        unaligned |= bool(r["fp8_misaligned"])
        tt.add_row(str(r["tp"]) + ("*" if r["fp8_misaligned"] else ""), str(r["ep"]), gib(r["weights_per_rank"]),
                   "[green]yes[/]" if r["fits"] else "[red]no[/]", _room(r["headroom_bytes"]), fmt_tokens(r["max_context"]))
    con.print(tt)
    if unaligned:
        con.print("* fp8: some per-rank slices are not 128-aligned at this degree (plan it with --tp to see which)")
    _search_table(con, p.pp_search, ctx)
    for w in p.warnings:
        con.print(f"[yellow]warning:[/] {w}")


def _stage_table(con: Console, pipe: dict) -> None:
    t = Table(title=f"Stages: tp {pipe['tp']} x pp {pipe['pp']} = {pipe['world_size']} ranks "
                    f"({pipe['nodes']} node(s) of {pipe['gpus_per_node']}); --pp-layers {pipe['pp_layers']}")
    for col in ("stage", "layers", "weights/rank", "KV/rank", "fits", "headroom", "max context"):
        t.add_column(col, justify="right")
    for f in pipe["stages"]:
        a, b = f["layers"]
        t.add_row(str(f["stage"]), f"{a}-{b} ({f['layer_count']})", gib(f["weights_bytes"]), gib(f["kv_bytes"]),
                  "[green]yes[/]" if f["fits"] else "[red]no[/]", _room(f["headroom_bytes"]), fmt_tokens(f["max_context"]))
    con.print(t)
    con.print(f"weights per rank across stages: {gib(pipe['min_weights_per_rank'])} to {gib(pipe['weights_per_rank'])} "
              f"(imbalance {100 * pipe['imbalance']:.1f} %: the heaviest stage over the lightest); embeddings and "
              "vision on stage 0, final norm and head on the last")


def _search_table(con: Console, search: dict, ctx: str) -> None:
    t = Table(title=f"tp x pp on {search['device']} ({ctx}): the smallest pp that fits, per tp")
    for col in ("tp", "pp", "ranks", f"nodes of {search['gpus_per_node']}", "weights/rank", "imbalance", "headroom",
                "max context"):
        t.add_column(col, justify="right")
    for r in search["rows"]:
        if not r["fits"]:
            t.add_row(str(r["tp"]), "-", "-", "-", f"[dim]{r['reason']}[/]", "-", "-", "-")
            continue
        t.add_row(str(r["tp"]), str(r["pp"]), str(r["world_size"]), str(r["nodes"]), gib(r["weights_per_rank"]),
                  f"{100 * r['imbalance']:.1f} %", _room(r["headroom_bytes"]), fmt_tokens(r["max_context"]))
    con.print(t)
    b = search["best"]
    if b is None:
        con.print(f"no tp x pp with up to {search['max_pp']} stages fits {search['device']} at {ctx}")
        return
    con.print(f"smallest tp x pp that fits on {search['device']} at {ctx}: [bold]--tp {b['tp']} --pp {b['pp']}[/] = "
              f"{b['world_size']} devices, {b['nodes']} node(s) of {search['gpus_per_node']} (--pp-layers "
              f"{b['pp_layers']}; imbalance {100 * b['imbalance']:.1f} %)")
