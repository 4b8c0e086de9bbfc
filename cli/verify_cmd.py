"""`kconvert reference` (reference log-probs from transformers) and `kconvert verify`."""

from __future__ import annotations

import contextlib
import json

import click

from kconvert.kv_rows import KV_DTYPES

from .progress import byte_progress
from kconvert.arguments import number

from kconvert.verify.prompts import MAX_PROMPT_TOKENS, MAX_TOKENS_LIMIT

from .params import COUNT, Whole


@click.command()
@click.argument("src")
@click.option("--out", "out", required=True, type=click.Path(dir_okay=False), help="REF.safetensors to write.")
@click.option("--prompts", "prompts_file", type=click.Path(dir_okay=False),
              help="JSON prompt list (default: the built-in set: short, long > index_topk, chat, image).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True,
              help="Reference compute dtype.")
@click.option("--top-k", type=COUNT, help="Store only the top K log-probs + the log-mass of the rest (smaller file).")
@click.option("--hidden-states", is_flag=True, help="Also store every layer's hidden states (for verify --per-layer).")
@click.option("--like", "like", type=click.Path(exists=True, file_okay=False),
              help="Converted dir: fake-quantize SRC's weights as it did (the faithfulness reference).")
@click.option("--max-prompt-tokens", type=Whole(1, MAX_TOKENS_LIMIT), default=MAX_PROMPT_TOKENS, show_default=True,
              help="Refuse a prompt longer than this many tokens before any model is built (the cost grows with it).")
@click.option("--json", "as_json", is_flag=True, help="Print the reference's metadata as JSON.")
def reference(src, out, prompts_file, dtype, top_k, hidden_states, like, max_prompt_tokens, as_json):
    """Run the reference implementation (transformers) on checkpoint SRC and store its next-token
    log-probabilities for every prompt position in OUT, for `kconvert verify --reference OUT`.
    DSA index-score ties go to the earliest positions, as in the engine. With --like CONVERTED,
    SRC's weights are first quantized and dequantized the way CONVERTED claims to hold them (by
    compressed-tensors, independently of kconvert's quantizers): pass that file to verify as
    --faithful-reference.

    \b
    Example:
      kconvert reference ./tiny-k25-dsv32 --out ref.safetensors --hidden-states
      kconvert reference ./tiny-k25-dsv32 --out fq.safetensors --like ./tiny-k25-dsv32-tp2-fp8 --hidden-states
    """
    from kconvert.source.checkpoint import Checkpoint
    from kconvert.verify.prompts import load_prompts
    from kconvert.verify.reference import run_reference

    ck = Checkpoint.open(src, headers_only=True)
    prompts = load_prompts(prompts_file, ck.config)
    from kconvert.io.workdir import terminate_as_interrupt

    with terminate_as_interrupt(), byte_progress("reference", enabled=not as_json, unit="items") as cb:
        cb("start", total=len(prompts))
        meta = run_reference(src, out, prompts, dtype=dtype, top_k=top_k, hidden_states=hidden_states, like=like,
                             progress=cb, max_prompt_tokens=max_prompt_tokens)
    if as_json:
        click.echo(json.dumps(meta, indent=2))
    else:
        click.echo(f"wrote {out}: {len(meta['prompts'])} prompts, {meta['family']}, {dtype}"
                   + (f", top-{top_k}" if top_k else ", full log-probs"))


@click.command()
@click.argument("out", type=click.Path(exists=True, file_okay=False))
@click.option("--reference", "reference_file", type=click.Path(dir_okay=False),
              help="REF.safetensors from `kconvert reference` (made from the same source).")
@click.option("--faithful-reference", "faithful_file", type=click.Path(dir_okay=False),
              help="From `kconvert reference SRC --like OUT` (default: made now from the source).")
@click.option("--against", "against", help="Source checkpoint (default: the path kconvert.json records).")
@click.option("--per-layer", is_flag=True, help="Hidden-state error per layer, first faulty layer, tensors to blame.")
@click.option("--device", default="cpu", show_default=True, help="Device the engine runs on.")
@click.option("--force", is_flag=True, help="Compare even if the reference was made from another source.")
@click.option("--tp", type=COUNT, default=1, show_default=True,
              help="An exported (Hugging Face-layout) OUT is resharded for this many ranks first.")
@click.option("--threshold", "threshold", multiple=True, metavar="KEY=VALUE",
              help="Override a limit: mean_kld, p99_kld, same_top1_pct, ppl_ratio (cost budget), "
                   "faithful.KEY (faithfulness) or draft.mean_kld / draft.mean_kld_quantized / draft.acceptance_drop / "
                   "draft.new_tokens "
                   "(draft heads); repeatable.")
@click.option("--plot", "plot_file", type=click.Path(dir_okay=False), help="Write a PNG (needs matplotlib).")
@click.option("--kv-dtype", type=click.Choice(KV_DTYPES),
              help="Run the engine with this KV cache format: the KLD then includes what KV quantization adds "
                   "(fp8 / int8: 8-bit latent, bf16 indexer keys; fp8-ds: fp8 keys too, DeepSeek-V3.2's layout).")
@click.option("--kv-budget", help="Bytes the engine's KV cache may take (8GiB), or a fraction of free memory (0.9).")
@click.option("--kv-device-budget",
              help="Bytes of KV pages kept on the device; older pages go to the host tier (the logits must not change).")
@click.option("--json", "as_json", is_flag=True, help="Print the full report as JSON.")
def verify(out, reference_file, faithful_file, against, per_layer, device, force, tp, threshold, plot_file, kv_dtype,
           kv_budget, kv_device_budget, as_json):
    """Check converted (or exported: see --tp) checkpoint OUT: integrity first, then two questions. Faithfulness: does the
    engine on OUT match the source fake-quantized with OUT's own scheme (any slicing, scale or
    placement fault FAILs: "the conversion is wrong")? Cost: KLD, same-top-1, RMS Δp, PPL ratio
    (llama.cpp's --kl-divergence report) vs the unquantized reference, by prompt kind, against the
    scheme's budget ("the scheme is too lossy for this model"). Draft heads (MTP) OUT holds: each head's
    predictions vs the reference's and its acceptance in greedy speculative decoding vs the source head's
    own. Exit 0 PASS, 1 FAIL, 2 bad input.

    \b
    Example:
      kconvert fixture tiny-k25-dsv32-trained ./tk25 && kconvert shard ./tk25 ./tk25-tp2-fp8 --tp 2 --quant fp8
      kconvert reference ./tk25 --out ref.safetensors --hidden-states
      kconvert verify ./tk25-tp2-fp8 --reference ref.safetensors --per-layer
      kconvert verify ./tk25-tp2-fp8 --reference ref.safetensors --threshold mean_kld=0.01
      kconvert verify ./tk25-w4a16 --reference ref.safetensors --tp 2   # an export: resharded, then verified
      kconvert verify ./tk25-tp2-fp8 --reference ref.safetensors --kv-dtype fp8 --kv-device-budget 64KiB
    """
    from kconvert.errors import UsageError
    from kconvert.errors import VerifyFailed
    from kconvert.verify.verdict import CHECKED, run_verify

    DRAFT_KEYS = ("draft.mean_kld", "draft.mean_kld_quantized", "draft.acceptance_drop", "draft.new_tokens")
    # what a limit can mean: a share of positions is a percentage, a perplexity ratio at least 1, a share of drafts
    # at most 1, a count of tokens at least 1 (same_top1_pct=200 or ppl_ratio=0.5 could never be met)
    THRESHOLD_RANGES = {"same_top1_pct": (0, 100), "ppl_ratio": (1, None), "draft.acceptance_drop": (0, 1),
                        "draft.new_tokens": (1, 4096)}

    from engine.cache.budget import kv_options

    kv_options(kv_dtype, kv_budget, kv_device_budget, device)  # bad KV options fail before any work
    if plot_file:  # before minutes of verification, not after
        from kconvert.deps import require

        require("matplotlib")
    limits = {}
    for item in threshold:
        key, _, value = item.partition("=")
        if key.removeprefix("faithful.") not in CHECKED and key not in DRAFT_KEYS:
            raise UsageError(f"unknown threshold {key!r} ({', '.join(CHECKED)}, faithful.KEY or {', '.join(DRAFT_KEYS)})")
        limits[key] = number(value, f"--threshold {key}", *THRESHOLD_RANGES.get(key.removeprefix("faithful."), (0, None)))
        if key == "draft.new_tokens":
            limits[key] = int(limits[key])
    from kconvert.io.workdir import terminate_as_interrupt
    from kconvert.inspect.converted import is_converted
    from kconvert.verify.exported import as_converted, describe

    # SIGTERM as Ctrl-C: the temporary reshard and results are removed, the spawned ranks stopped
    with terminate_as_interrupt(), contextlib.ExitStack() as stack, \
            byte_progress("verify", enabled=not as_json, unit="items") as cb:
        target, export = out, None
        if not is_converted(out):  # an export: resharded into a temporary converted dir
            export = describe(out)
            cb("phase", name=f"reshard the {export.format} export for tp {tp}")
            target = stack.enter_context(as_converted(export, tp))
        rep = run_verify(target, reference=reference_file, faithful_reference=faithful_file, against=against,
                         per_layer=per_layer, device=device, force=force, limits=limits, progress=cb,
                         kv=(kv_dtype, kv_budget, kv_device_budget), export=export)
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
    # the terminal gets the llama.cpp set; --json has median, p99.9, cosine and max |Δ log p| too
    cols = [("pos", "positions", "{:d}"), ("mean KLD", "mean_kld", "{:.3g}"), ("p99 KLD", "p99_kld", "{:.3g}"),
            ("max KLD", "max_kld", "{:.3g}"), ("top-1", "same_top1_pct", "{:.2f}%"), ("RMS Δp", "rms_dp_pct", "{:.3f}%"),
            ("PPL ×", "ppl_ratio", "{:.4f}")]
    for title, check in ((f"faithfulness: vs {rep.faithfulness.reference}", rep.faithfulness),
                         ("cost: vs the unquantized source", rep.cost)):
        if check.verdict == "SKIPPED":
            con.print(f"faithfulness: [yellow]SKIPPED[/] ({check.reference})")
            continue
        t = Table(title=f"{rep.out}: {rep.scheme}, tp {rep.tp}{f' x pp {rep.pp}' if rep.pp > 1 else ''}; {title}")
        t.add_column("prompts")
        for head, _, _ in cols:
            t.add_column(head, justify="right")
        for name, row in [*check.by_kind.items(), ("all", check.overall)]:
            t.add_row(f"[bold]{name}[/]" if name == "all" else name, *[f.format(row[k]) for _, k, f in cols])
        con.print(t)
        color = "green" if check.verdict == "PASS" else "red"
        limits = ", ".join(f"{k} {v}" for k, v in check.limits.items())
        con.print(f"  [{color}]{check.verdict}[/] ({limits})" + (f": {'; '.join(check.failures)}" if check.failures else ""))
    if rep.cost.per_layer:
        lt = Table(title="hidden-state relative error by layer")
        lt.add_column("after")
        lt.add_column("vs faithful ref.", justify="right")
        lt.add_column("vs unquantized", justify="right")
        faith = rep.faithfulness.per_layer or [None] * len(rep.cost.per_layer)
        for f, c in zip(faith, rep.cost.per_layer):
            lt.add_row(c["after"], f"{f['rel_error']:.3e}" if f else "-", f"{c['rel_error']:.3e}")
        con.print(lt)
        if rep.vision_error is not None:
            con.print(f"vision tower output vs unquantized: rel. error {rep.vision_error:.3e}")
        if rep.fault_at is not None:
            con.print(f"first fault: [bold red]{rep.fault_at}[/] (tensors to blame below)")
        if rep.largest_error_step_layer is not None:
            con.print(f"layer adding the most quantization error: {rep.largest_error_step_layer}")
        if rep.attribution:
            head, *rows = rep.attribution
            at = Table(title=f"layer {head['layer']}: output error {head['layer_error']:.3e}; share removed when faithful")
            at.add_column("tensor")
            at.add_column("share", justify="right")
            for r in rows[:8]:
                at.add_row(r["tensor"], f"{100 * r['share']:.1f} %")
            con.print(at)
    for kind, c in (rep.exact_casts or {}).items():
        total = c["exact"] + c["data_derived"]
        con.print(f"exact cast {kind}: {c['exact']} of {total} blocks exact"
                  + (f", [yellow]{c['data_derived']} data-derived (lossy)[/]" if c["data_derived"] else ""))
    if rep.draft is not None:
        _print_draft(con, rep.draft)
    color = "green" if rep.verdict == "PASS" else "red"
    con.print(f"[bold {color}]{rep.verdict}[/] in {rep.seconds:.1f} s" + (f": {'; '.join(rep.failures)}" if rep.failures else ""))


def _print_draft(con, check) -> None:
    """The draft heads' table: predictions vs the reference, acceptance vs the source head's own."""
    from rich.table import Table

    t = Table(title=f"draft heads: predictions vs {check.reference}; greedy speculative decoding, "
                    f"{check.limits.get('new_tokens')} tokens a prompt")
    for col in ("head", "mean KLD", "top-1", "acceptance", "source head", "tokens/step", "verdict"):
        t.add_column(col, justify="left" if col == "head" else "right")
    for h in check.heads:
        kl = h.get("mean_kld")
        t.add_row(h["head"], "-" if kl is None else f"{kl:.3g}",
                  "-" if kl is None else f"{h['same_top1_pct']:.2f}%", f"{100 * h['acceptance']:.1f}%",
                  "-" if h.get("reference_acceptance") is None else f"{100 * h['reference_acceptance']:.1f}%",
                  f"{h['tokens_per_step']:.2f}", h.get("verdict", check.verdict))
    con.print(t)
    color = {"PASS": "green", "FAIL": "red"}.get(check.verdict, "yellow")
    limits = (f"mean KLD {check.limits['mean_kld']} copied / {check.limits['mean_kld_quantized']} quantized, "
              f"acceptance drop {check.limits['acceptance_drop']}")
    con.print(f"  [{color}]{check.verdict}[/] ({limits})" + (f": {'; '.join(check.failures)}" if check.failures else ""))
