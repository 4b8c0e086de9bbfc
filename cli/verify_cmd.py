"""`kconvert reference` (reference log-probs from transformers) and `kconvert verify`."""

from __future__ import annotations

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
    from kconvert.checkpoint import Checkpoint
    from kconvert.prompts import load_prompts
    from kconvert.reference import run_reference

    ck = Checkpoint.open(src, headers_only=True)
    prompts = load_prompts(prompts_file, ck.text_config.get("index_topk"))
    with byte_progress("reference", enabled=not as_json, unit="items") as cb:
        cb("start", total=len(prompts))
        meta = run_reference(src, out, prompts, dtype=dtype, top_k=top_k, hidden_states=hidden_states, progress=cb)
    if as_json:
        click.echo(json.dumps(meta, indent=2))
    else:
        click.echo(f"wrote {out}: {len(meta['prompts'])} prompts, {meta['family']}, {dtype}"
                   + (f", top-{top_k}" if top_k else ", full log-probs"))
