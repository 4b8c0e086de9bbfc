"""`kconvert fixture PRESET OUT`: generate a real-format test checkpoint with random weights."""

from __future__ import annotations

import click

from .units import fmt_bytes, parse_size


def _presets_help() -> str:
    try:
        from kconvert.fixtures import PRESETS
    except ImportError:
        return ""
    return "\n".join(f"  {name:<14} {desc}" for name, desc in PRESETS.items())


@click.command(epilog="\b\nPresets:\n" + _presets_help())
@click.argument("preset")
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--seed", default=0, show_default=True, help="Random seed (same seed, same bytes).")
@click.option("--size", help="Target size for the `scale` preset, e.g. 2GB, 8GB.")
def fixture(preset: str, out: str, seed: int, size: str | None) -> None:
    """Write checkpoint PRESET (random weights, real names, shapes and formats) to OUT.

    Built with transformers' own model classes (install the `ref` extra), saved as sharded
    safetensors with an index, config.json and a Kimi-format tokenizer.

    \b
    Example:
      kconvert fixture tiny-k3 ./tiny-k3
      kconvert fixture scale ./scale-8g --size 8GB
    """
    from kconvert.fixtures import build_fixture

    path = build_fixture(preset, out, seed=seed, size=parse_size(size) if size else None)
    total = sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    click.echo(f"wrote {preset} to {path} ({fmt_bytes(total)})")
