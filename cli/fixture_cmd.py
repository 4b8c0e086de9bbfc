"""`kconvert fixture PRESET OUT`: generate a real-format test checkpoint (seeded random weights, or trained)."""

from __future__ import annotations

import click

from .progress import byte_progress
from .units import fmt_bytes, parse_size
from .params import SEED, Whole


def _presets_help() -> str:
    try:
        from kconvert.fixtures import PRESETS
    except ImportError:
        return ""
    return "\n".join(f"  {name:<14} {desc}" for name, desc in PRESETS.items())


MAX_EXPERT_INSTANCES = 262144  # limits.toml's expert_instances: layers x routed experts a config may hold


@click.command(epilog="\b\nPresets:\n" + _presets_help())
@click.argument("preset")
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--seed", type=SEED, default=0, show_default=True, help="Random seed (same seed, same bytes).")
@click.option("--size", help="Target size for the `scale` preset, e.g. 2GB, 8GB.")
@click.option("--layers", type=Whole(2, 1024), help="Decoder layers of a topo-* preset (default: the release's).")
@click.option("--experts", type=Whole(1, 65536), help="Routed experts of a topo-* preset (default: the release's).")
def fixture(preset: str, out: str, seed: int, size: str | None, layers: int | None, experts: int | None) -> None:
    """Write checkpoint PRESET (real names, shapes and formats) to OUT: seeded random weights, or for
    the `-trained` presets a small base model trained on Python standard-library sources.

    Built with transformers' own model classes (install the `ref` extra), saved as sharded
    safetensors with an index, config.json and a Kimi-format tokenizer. The `-trained` presets
    train the text model first (about 2 minutes on 2 cores); their verify prompts (`stdlib-heldout`)
    come from stdlib files they never saw. They are base models, not chat models: continue code with
    `python -m engine.chat OUT --complete --prompt "def main("`.

    \b
    Example:
      kconvert fixture tiny-k25-dsv32 ./tiny-k25-dsv32
      kconvert fixture tiny-k25-dsv32-trained ./tiny-k25-dsv32-trained --seed 0
      kconvert fixture scale ./scale-8g --size 8GB
      kconvert fixture topo-k25 ./topo-k25                      # 61 x 384 experts, ~210k tensors
      kconvert fixture topo-k25 ./topo-small --layers 4 --experts 16
    """
    from kconvert.fixtures import kernels

    kernels.pin()  # before torch is imported: a trained preset's bytes are the same on AVX2 and AVX-512 CPUs
    from kconvert import renamed
    from kconvert.fixtures import build_fixture
    from kconvert.fixtures.presets import TOPOLOGY_PRESETS, TRAINED_PRESETS

    old = renamed.note(renamed.PRESETS, preset, "preset")
    if old:
        click.echo(old, err=True)
        preset = renamed.current(renamed.PRESETS, preset)
    if preset in TOPOLOGY_PRESETS:  # the bounds kconvert reads a config with (limits.toml), before any memory is used
        n_layers, n_experts = layers or TOPOLOGY_PRESETS[preset][0], experts or TOPOLOGY_PRESETS[preset][1]
        if n_layers * n_experts > MAX_EXPERT_INSTANCES:
            from kconvert.errors import UsageError

            raise UsageError(f"--layers {n_layers} x --experts {n_experts} = {n_layers * n_experts} routed experts: "
                             f"past the {MAX_EXPERT_INSTANCES} kconvert reads (manifests/limits.toml)")
    with byte_progress(f"fixture {preset}", unit="items", enabled=preset in TRAINED_PRESETS) as cb:
        def training(event: str, **kw) -> None:  # the -trained presets: steps and loss as they go
            if event == "start":
                cb("phase", name=kw["phase"])
                cb("start", total=kw["total"], restart=True)
            else:
                cb("advance", n=1)
                cb("file", path=f"loss {kw['loss']:.3f}")

        path = build_fixture(preset, out, seed=seed, size=parse_size(size, "--size") if size else None,
                             progress=training, layers=layers, experts=experts)
    total = sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    training = path / "kconvert_training.json"
    trained = ""
    if training.exists():
        import json

        rec = json.loads(training.read_text())
        trained = f", trained {rec['steps']} steps: loss {rec['loss_first']:.2f} -> {rec['loss_last10_mean']:.2f}"
    click.echo(f"wrote {preset} to {path} ({fmt_bytes(total)}{trained})")
