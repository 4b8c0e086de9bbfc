"""`kconvert serve-check OUT`: an export loaded (and, with --reference, run) by vLLM itself; `export --check vllm`."""

from __future__ import annotations

import json

import click


@click.command("serve-check")
@click.argument("out", type=click.Path(exists=True, file_okay=False))
@click.option("--engine", type=click.Choice(["vllm"]), default="vllm", show_default=True,
              help="The serving engine that loads OUT (its CPU backend, in its own environment: `make vllm-env`).")
@click.option("--reference", type=click.Path(exists=True, dir_okay=False),
              help="A `kconvert reference` file: also run vLLM on its prompts and compare log-probs (mean KL, top-1).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]),
              help="vLLM's model dtype (default: float32 unquantized, bfloat16 quantized: vLLM's FP8 takes no float32).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def serve_check(out, engine, reference, dtype, as_json):
    """Load export OUT in vLLM's own model class on the CPU, with vLLM's own loader, and compare every weight as
    vLLM holds it (dequantized from the parameters it loaded, in the dtypes it chose) with kconvert's reading of
    the same tensor: a table per tensor kind (found / missing / unexpected / largest difference as loaded).
    Exit 0 PASS, 1 FAIL (or vLLM refused the export: its error line), 2 bad input or no vLLM environment.

    \b
    Example:
      make vllm-env                                   # once: vLLM's CPU backend in .venv-vllm
      kconvert export ./tiny-dsv3 ./tiny-dsv3-fp8 --format fp8-block
      kconvert serve-check ./tiny-dsv3-fp8
      kconvert serve-check ./tiny-dsv3-bf16 --reference ref.safetensors   # + vLLM's log-probs vs the reference
    """
    code = check_and_report(out, reference, dtype, as_json)
    if code:
        raise click.exceptions.Exit(code)


def check_and_report(out: str, reference: str | None, dtype: str | None, as_json: bool, extra: dict | None = None) -> int:
    """Run the checks, print them (a table, or JSON with `extra` beside), return the exit code (0 PASS, 1 FAIL)."""
    from kconvert.verify.vllm_check.check import load_check, run_check

    load = load_check(out, dtype=dtype)
    run = run_check(out, reference, dtype=dtype) if reference else None
    if as_json:
        doc = {**(extra or {}), "load": load.to_json(), **({"run": run.to_json()} if run else {})}
        click.echo(json.dumps(doc, indent=2))
    else:
        print_load(load)
        if run and run.refused:
            click.echo(f"vLLM could not run it: {run.refused}")
        elif run:
            s = run.summary
            click.echo(f"vLLM run ({run.dtype}) vs reference: {s.positions} positions, mean KL {s.mean_kld:.3g}, "
                       f"max KL {s.max_kld:.3g}, same top-1 {s.same_top1_pct:.2f} %")
    return 0 if load.passed and not (run and run.refused) else 1


def print_load(load) -> None:
    from rich.console import Console
    from rich.table import Table

    if load.refused:
        click.echo(f"{load.export}: vLLM {load.vllm} could not load it: {load.refused}\nFAIL")
        return
    table = Table(title=f"{load.export} as vLLM {load.vllm} loads it ({load.model_class}, {load.dtype})")
    for col in ("kind", "found", "missing", "unexpected", "max error as loaded"):
        table.add_column(col, justify="left" if col == "kind" else "right")
    for r in load.rows:
        note = f" ({r.draft} draft)" if r.draft else ""
        err = "exact" if r.max_error == 0 else f"{r.max_error:.3g}"
        table.add_row(r.kind + note, str(r.found), "-", str(r.unexpected), err)
    if load.missing:
        cells = sum(c for c, _ in load.missing.values())
        table.add_row("vLLM parameters no tensor filled", "-", f"{len(load.missing)} ({cells} cells)", "-", "-")
    con = Console()
    con.print(table)
    for r in load.rows:
        if r.max_error:
            con.print(f"largest difference, {r.kind}: {r.worst} ({r.max_error:.3g})", markup=False)
    if any(r.draft for r in load.rows):
        con.print("draft layers: not part of vLLM's target model (its MTP model loads them); not checked", markup=False)
    for name in load.unexpected[:10]:
        con.print(f"unexpected: {name}", markup=False)
    for name, (cells, total) in list(load.missing.items())[:10]:
        con.print(f"missing: {name} ({cells} of {total} cells)", markup=False)
    for claim in load.kernels_claimed:
        con.print(f"note: built without its kernel (load only): {claim}", markup=False, soft_wrap=True)
    con.print("PASS" if load.passed else "FAIL", markup=False)
