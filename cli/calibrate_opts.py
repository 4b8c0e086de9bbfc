"""`--calibrate DATA` and its knobs, shared by `shard` and `export`: the options, and the factory the
library calls once it knows the source and the quantization policy (engine/calibrate/layerwise.py does the work)."""

from __future__ import annotations

import click

from kconvert.source.calibration_data import (BUNDLED, DEFAULT_SEED, DEFAULT_SEQ, DEFAULT_TOKENS, MAX_SEQ, MAX_TOKENS,
                                              check_data_name, check_out_outside)

from .params import SEED, Whole


def calibration_options(f):
    """Adds --calibrate, --calibration-tokens, --calibration-seq, --calibration-seed to a command."""
    for opt in reversed((
        click.option("--calibrate", "calibrate_data", metavar="DATA",
                     help=f"int4 and nvfp4: GPTQ codes calibrated layer by layer on DATA (a text file, a directory of text files, "
                          f"JSONL of {{\"text\"}} or {{\"messages\"}}; '{BUNDLED}': bundled Python sources, for tests)."),
        click.option("--calibration-tokens", type=Whole(1, MAX_TOKENS), default=DEFAULT_TOKENS, show_default=True,
                     help="Calibration tokens (rounded up to whole sequences)."),
        click.option("--calibration-seq", type=Whole(2, MAX_SEQ), default=DEFAULT_SEQ, show_default=True,
                     help="Tokens per calibration sequence."),
        click.option("--calibration-seed", type=SEED, default=DEFAULT_SEED, show_default=True,
                     help="Seed of the sequences drawn from DATA (recorded in kconvert.json)."),
        click.option("--calibration-grid", type=click.Choice(["kconvert", "minmax", "kimi"]),
                     help="Codes and static scales: shard's own (kconvert: -8..7, amax / 7 with the clipping search; "
                          "shard's default), compressed-tensors' min-max (-8..7, amax / 7.5; export's default) or "
                          "Kimi's 15 levels (-7..7, amax / 7; both commands). int4 only: nvfp4 has its e2m1 grid."),
    )):
        f = opt(f)
    return f


def calibration_factory(data: str | None, tokens: int, seq: int, seed: int, grid: str | None,
                        allowed: tuple[str, ...] = ("kconvert", "kimi"), *, out: str | None = None):
    """None without --calibrate; else `make(ck, policy, progress)` -> engine.calibrate.layerwise.LayerCalibration.
    `grid` None: the command's default, allowed[0] (the grid whose scales its encoding stores as they are).
    `out`: the command's OUT, refused inside a DATA directory (its files would be read as data by a rerun)."""
    from kconvert.errors import UsageError

    if data is None:
        if grid is not None:
            raise UsageError("--calibration-grid needs --calibrate DATA")
        return None
    check_data_name(data)  # before any work: '' would be the current directory
    if out is not None:
        check_out_outside(data, out)
    asked, grid = grid, grid or allowed[0]
    if grid not in allowed:
        raise UsageError(f"--calibration-grid {grid} is not one this command stores (choose from {', '.join(allowed)})")

    def make(ck, policy, progress):
        from engine.calibrate.layerwise import LayerCalibration
        from kconvert.quant.gptq import CALIBRATION_GRIDS
        from kconvert.source.calibration_data import calibration_windows
        from kconvert.source.tokenizer import load_tokenizer

        chosen = grid
        if policy.scheme == "nvfp4":  # one grid: e2m1 at the uncalibrated path's scales
            if asked is not None:
                raise UsageError(f"--calibration-grid {asked} is an int4 grid; nvfp4 calibrates on its own e2m1 grid "
                                 "(leave --calibration-grid out)")
            chosen = "nvfp4"
        enc = load_tokenizer(ck.root)  # tiktoken.model or tokenizer.json; none: one line naming the directory
        windows, record = calibration_windows(data, lambda t: enc.encode(t, allowed_special="all"), tokens, seq, seed)
        return LayerCalibration(ck, windows, policy, CALIBRATION_GRIDS[chosen], record, progress)

    return make
