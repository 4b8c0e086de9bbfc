"""Sane bounds on config.json values (manifests/limits.toml), checked before any work.

config.json is untrusted input: without bounds, num_hidden_layers = 10**9 makes inspect/plan run
for minutes, a string where a number belongs reaches the shape evaluator, and weight_block_size = 0
divides by zero deep inside a reader. `check_bounds`, `check_relations` and `check_quantization` refuse such values
with one line naming config.json and the field (ManifestError, exit 2).
"""

from __future__ import annotations

import functools
import math
import tomllib
from collections.abc import Mapping
from pathlib import Path

from kconvert.errors import ManifestError, MissingKey
from kconvert.family.expr import evaluate

LIMITS_FILE = "limits.toml"
# The quantization_config kinds kconvert reads, and what their weight groups may say: a config that names another
# method (bitsandbytes' uint8, a typo) or bits kconvert does not store would be read by tensor names alone, and
# what the config claims would silently disagree with what engines and transformers do with it.
# ModelOpt's (NVIDIA's NVFP4 builds; `modelopt_mixed`: its MIXED_PRECISION checkpoints, as ModelOpt's K3 recipe writes)
QUANT_METHODS = ("fp8", "compressed-tensors", "modelopt", "modelopt_mixed")
WEIGHT_BITS = {"int": (4, 8), "float": (4, 8)}  # compressed-tensors weights: INT4 / INT8, FP4 (MXFP4) / FP8


@functools.lru_cache(maxsize=None)
def limits(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ManifestError(f"limits unreadable: {e}", file=str(path)) from None


def _show(v) -> str:
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_value(field: str, value, bound, *, file: str) -> None:
    """One value against one bound of limits.toml (see its header for the forms)."""
    def bad(why: str) -> ManifestError:
        return ManifestError(f"{field} = {_show(value)}: {why} (bounds: manifests/limits.toml, docs/LIMITS.md)",
                             file=file)

    if bound == "bool":
        if not isinstance(value, bool):
            raise bad("must be true or false")
        return
    if isinstance(bound, Mapping):  # a list of integers
        n, lo, hi = bound["length"], bound["min"], bound["max"]
        if not (isinstance(value, list) and len(value) == n and all(_is_int(v) and lo <= v <= hi for v in value)):
            raise bad(f"must be a list of {n} integers in [{lo}, {hi}]")
        return
    lo, hi = bound
    if _is_int(lo):
        if not _is_int(value):
            raise bad("must be an integer")
    elif not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)):
        raise bad("must be a finite number")
    if not lo <= value <= hi:
        raise bad(f"outside [{lo}, {hi}]")


def check_bounds(part: str, config: Mapping, defaults: Mapping, *, prefix: str, file: str, limits_path: Path) -> None:
    """A part's config keys against their bounds in limits.toml."""
    spec = limits(limits_path).get("part", {}).get(part, {})
    for key, bound in spec.get("bounds", {}).items():
        head, _, tail = key.partition(".")  # "section.key": a key inside a nested config section
        where = config.get(head) if tail else config
        name = tail or key
        if not isinstance(where, Mapping) or name not in where or (where[name] is None and key in defaults):
            continue
        check_value(prefix + key, where[name], bound, file=file)


def check_relations(part: str, env: Mapping, *, prefix: str, file: str, limits_path: Path) -> None:
    """A part's relations in limits.toml, on `env` (config + defaults, with any keys the family rebinds)."""
    spec = limits(limits_path).get("part", {}).get(part, {})
    for name, expr in spec.get("relations", {}).items():
        try:
            ok = evaluate(expr, env)
        except MissingKey:
            continue
        except ManifestError as e:
            raise ManifestError(f"{prefix}{name}: {e.message}", file=file) from None
        if not ok:
            raise ManifestError(f"values break {expr!r} ({prefix or 'config'}: {name}; docs/LIMITS.md)", file=file)


def check_quantization(qc, *, field: str, file: str, limits_path: Path) -> None:
    """quantization_config: a mapping whose block size and group sizes the readers can divide by."""
    if qc is None:
        return
    if not isinstance(qc, Mapping):
        raise ManifestError(f"{field} = {_show(qc)}: must be an object", file=file)
    bounds = limits(limits_path).get("quantization", {})
    method = qc.get("quant_method")
    if method is not None and method not in QUANT_METHODS:
        raise ManifestError(f"{field}.quant_method = {_show(method)}: kconvert reads {' and '.join(QUANT_METHODS)} "
                            "checkpoints", file=file)
    if method == "compressed-tensors" and not (isinstance(qc.get("config_groups"), Mapping) and qc["config_groups"]):
        raise ManifestError(f"{field}.config_groups = {_show(qc.get('config_groups'))}: compressed-tensors needs at "
                            "least one group", file=file)
    if qc.get("weight_block_size") is not None:
        check_value(f"{field}.weight_block_size", qc["weight_block_size"], bounds["weight_block_size"], file=file)
    groups = qc.get("config_groups")
    if groups is None:
        return
    if not isinstance(groups, Mapping):
        raise ManifestError(f"{field}.config_groups = {_show(groups)}: must be an object", file=file)
    for name, group in groups.items():
        if not isinstance(group, Mapping):
            raise ManifestError(f"{field}.config_groups.{name} = {_show(group)}: must be an object", file=file)
        weights = group.get("weights")
        if weights is not None and not isinstance(weights, Mapping):
            raise ManifestError(f"{field}.config_groups.{name}.weights = {_show(weights)}: must be an object", file=file)
        if weights:
            _check_weight_bits(weights, f"{field}.config_groups.{name}.weights", file)
        if weights and weights.get("group_size") is not None:
            check_value(f"{field}.config_groups.{name}.weights.group_size", weights["group_size"],
                        bounds["group_size"], file=file)


def _check_weight_bits(weights: Mapping, field: str, file: str) -> None:
    kind, bits = weights.get("type", "int"), weights.get("num_bits")
    if kind not in WEIGHT_BITS:
        raise ManifestError(f"{field}.type = {_show(kind)}: must be one of {', '.join(WEIGHT_BITS)}", file=file)
    if bits is not None and (not _is_int(bits) or bits not in WEIGHT_BITS[kind]):
        raise ManifestError(f"{field}.num_bits = {_show(bits)}: {kind} weights are stored in "
                            f"{' or '.join(map(str, WEIGHT_BITS[kind]))} bits", file=file)
