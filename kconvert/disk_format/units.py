"""Units: what the loader streams and the engine builds one at a time. A converted directory holds one
file per (rank, unit): `globals` (embeddings, final norm, head), `vision` (tower + projector) and
`layer-NNNN` (one decoder layer). Unit names are made and parsed here only."""

from __future__ import annotations

import re

MANIFEST = "kconvert.json"  # a converted directory's catalog (converted/catalog.py), written last
GLOBALS = "globals"
VISION = "vision"
_LAYER = re.compile(r"layer-(\d{4,})")


def layer_unit(layer: int) -> str:
    return f"layer-{layer:04d}"


def unit_layer(unit: str) -> int | None:
    """The decoder layer of a unit name, None for globals/vision; ValueError for anything else."""
    if unit in (GLOBALS, VISION):
        return None
    m = _LAYER.fullmatch(unit) if isinstance(unit, str) else None
    if m is None:
        raise ValueError(f"not a unit name: {unit!r}")
    return int(m.group(1))


def is_unit(unit: object) -> bool:
    try:
        unit_layer(unit)  # type: ignore[arg-type]
        return True
    except ValueError:
        return False


def unit_file(rank: int, unit: str) -> str:
    """Relative path of one rank's file for a unit ('globals', 'vision' or 'layer-0007')."""
    return f"rank-{rank:03d}/{unit}.safetensors"


def load_order(units: set[str] | list[str]) -> list[str]:
    """globals, vision, then layers in order: the order a model is built in."""
    head = [u for u in (GLOBALS, VISION) if u in units]
    return head + sorted((u for u in units if u not in (GLOBALS, VISION)), key=lambda u: unit_layer(u))
