"""`kconvert reference` (reference log-probs from transformers) and `kconvert verify`."""

from __future__ import annotations

import contextlib
import json

import click

from .progress import byte_progress


@click.command()
@click.argument("src")
@click.option("--out", "out", required=True, type=click.Path(dir_okay=False), help="REF.safetensors to write.")
@click.option("--prompts", "prompts_file", type=click.Path(dir_okay=False),
              help="JSON prompt list (default: the built-in set: short, long > index_topk, chat, image).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True,
              help="Reference compute dtype.")
@click.option("--top-k", type=int, help="Store only the top K log-probs + the log-mass of the rest (smaller file).")
@click.option("--hidden-states", is_flag=True, help="Also store every layer's hidden states (for verify --per-layer).")
@click.option("--json", "as_json", is_flag=True, help="Print the reference's metadata as JSON.")
def reference(src, out, prompts_file, dtype, top_k, hidden_states, as_json):
    """Run the reference implementation (transformers) on checkpoint SRC and store its next-token
    log-probabilities for every prompt position in OUT, for `kconvert verify --reference OUT`.

    \b
    Example:
      kconvert reference ./tiny-k3 --out ref.safetensors --hidden-states
    """
    from kconvert.source.checkpoint import Checkpoint
    from kconvert.verify.prompts import load_prompts
    from kconvert.verify.reference import run_reference

    ck = Checkpoint.open(src, headers_only=True)
    prompts = load_prompts(prompts_file, ck.config)
    with byte_progress("reference", enabled=not as_json, unit="items") as cb:
        cb("start", total=len(prompts))
        meta = run_reference(src, out, prompts, dtype=dtype, top_k=top_k, hidden_states=hidden_states, progress=cb)
    if as_json:
        click.echo(json.dumps(meta, indent=2))
    else:
        click.echo(f"wrote {out}: {len(meta['prompts'])} prompts, {meta['family']}, {dtype}"
                   + (f", top-{top_k}" if top_k else ", full log-probs"))


@click.command()
@click.argument("out", type=click.Path(exists=True, file_okay=False))
@click.option("--reference", "reference_file", type=click.Path(dir_okay=False),
              help="REF.safetensors from `kconvert reference` (made from the same source).")
@click.option("--against", "against", help="Source checkpoint: compute the reference now (slower).")
@click.option("--per-layer", is_flag=True, help="Hidden-state error per layer, first bad layer, tensors to blame.")
@click.option("--device", default="cpu", show_default=True, help="Device the engine runs on.")
@click.option("--force", is_flag=True, help="Compare even if the reference was made from another source.")
@click.option("--tp", type=int, default=1, show_default=True,
              help="An exported (Hugging Face-layout) OUT is resharded for this many ranks first.")
@click.option("--threshold", "threshold", multiple=True, metavar="KEY=VALUE",
              help="Override a PASS bound: mean_kld, p99_kld or same_top1_pct (repeatable).")
@click.option("--plot", "plot_file", type=click.Path(dir_okay=False), help="Write a PNG (needs matplotlib).")
@click.option("--kv-dtype", type=click.Choice(["bf16", "fp8"]),
              help="Run the engine with this KV cache format: the KLD then includes what KV quantization adds.")
@click.option("--json", "as_json", is_flag=True, help="Print the full report as JSON.")
def verify(out, reference_file, against, per_layer, device, force, tp, threshold, plot_file, kv_dtype, as_json):
    """Check converted (or exported: see --tp) checkpoint OUT against reference log-probabilities: integrity first, then
    KLD, same-top-1, RMS Δp, PPL ratio, cosine, max |Δ log p| (llama.cpp's --kl-divergence report),
    split by prompt kind, PASS/FAIL per the scheme's thresholds. Exit 0 PASS, 1 FAIL, 2 bad input.

    \b
    Example:
      kconvert reference ./tiny-k3 --out ref.safetensors --hidden-states
      kconvert verify ./tiny-k3-tp2-fp8 --reference ref.safetensors --per-layer
      kconvert verify ./tiny-k3-w4a16 --reference ref.safetensors   # an export: resharded, then verified
    """
    from kconvert.errors import UsageError
    from kconvert.errors import VerifyFailed
    from kconvert.verify.verdict import run_verify

    if kv_dtype:  # read by kconvert.verify.run.run_rank, in this process and in the ranks it spawns
        import os

        from kconvert.verify.run import KV_DTYPE_ENV

        os.environ[KV_DTYPE_ENV] = kv_dtype
    if plot_file:  # before minutes of verification, not after
        from kconvert.deps import require

        require("matplotlib")
    limits = {}
    for item in threshold:
        key, _, value = item.partition("=")
        if key not in ("mean_kld", "p99_kld", "same_top1_pct"):
            raise UsageError(f"unknown threshold {key!r} (mean_kld, p99_kld, same_top1_pct)")
        try:
            limits[key] = float(value)
        except ValueError:
            raise UsageError(f"threshold {key} needs a number, got {value!r}") from None
    from kconvert.verify.exported import as_converted, is_converted, reference_matches

    with contextlib.ExitStack() as stack, byte_progress("verify", enabled=not as_json, unit="items") as cb:
        target = out
        if not is_converted(out):  # an export: resharded into a temporary converted dir
            cb("phase", name="reshard")
            target, bounds, made_from = stack.enter_context(as_converted(out, tp))
            limits = {**bounds, **limits}
            force = force or reference_matches(made_from, reference_file, against)
        rep = run_verify(target, reference=reference_file, against=against, per_layer=per_layer, device=device,
                         force=force, limits=limits, progress=cb)
        rep.out = out
    if plot_file:
        from .verify_plot import plot

        plot(rep, plot_file)
    if as_json:
        click.echo(json.dumps(rep.to_json(), indent=2))
    else:
        _print_report(rep)
    if rep.verdict != "PASS":
        raise VerifyFailed("; ".join(rep.failures), file=out)


def _print_report(rep) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    t = Table(title=f"{rep.out}: {rep.scheme}, tp {rep.tp}")
    # the terminal gets the llama.cpp set; --json has median, p99.9, cosine and max |Δ log p| too
    cols = [("pos", "positions", "{:d}"), ("mean KLD", "mean_kld", "{:.5f}"), ("p99 KLD", "p99_kld", "{:.4f}"),
            ("max KLD", "max_kld", "{:.3f}"), ("top-1", "same_top1_pct", "{:.1f}%"), ("RMS Δp", "rms_dp_pct", "{:.2f}%"),
            ("PPL ×", "ppl_ratio", "{:.4f}")]
    t.add_column("prompts")
    for head, _, _ in cols:
        t.add_column(head, justify="right")
    for name, row in [*rep.by_kind.items(), ("all", rep.overall)]:
        t.add_row(f"[bold]{name}[/]" if name == "all" else name, *[f.format(row[k]) for _, k, f in cols])
    con.print(t)
    if rep.per_layer:
        lt = Table(title="hidden-state error by layer")
        lt.add_column("after")
        lt.add_column("rel. error", justify="right")
        for c in rep.per_layer:
            lt.add_row(c["after"], f"{c['rel_error']:.3e}")
        con.print(lt)
        if rep.vision_error is not None:
            con.print(f"vision tower output: rel. error {rep.vision_error:.3e}")
        if rep.first_bad_layer is not None:
            con.print(f"layer adding the most error: [bold]{rep.first_bad_layer}[/] (tensors to blame below)")
        if rep.attribution:
            head, *rows = rep.attribution
            at = Table(title=f"layer {head['layer']}: output error {head['layer_error']:.3e}; share removed when exact")
            at.add_column("tensor")
            at.add_column("share", justify="right")
            for r in rows[:8]:
                at.add_row(r["tensor"], f"{100 * r['share']:.1f} %")
            con.print(at)
    limits = ", ".join(f"{k} {v}" for k, v in rep.thresholds.items())
    color = "green" if rep.verdict == "PASS" else "red"
    con.print(f"[bold {color}]{rep.verdict}[/] ({limits}) in {rep.seconds:.1f} s"
              + (f": {'; '.join(rep.failures)}" if rep.failures else ""))
