"""Sane bounds on config.json values (manifests/limits.toml), checked before any work.

config.json is untrusted input: without bounds, num_hidden_layers = 10**9 makes inspect/plan run
for minutes, a string where a number belongs reaches the shape evaluator, and weight_block_size = 0
divides by zero deep inside a reader. `check_bounds`, `check_relations`, `run_checks` and `check_quantization`
refuse such values with one line naming config.json and the field (ManifestError, exit 2). Every key the engine
reads is bounded here, and every rule the engine applies to a config (DeepSeek-V4.1's layer roles, the rotary
settings) runs here too (`run_checks`: kconvert/family/config_checks.py), so a config inspect and shard accept is
one the engine runs: no finished conversion is refused at load time.
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
_ABSENT = object()


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


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def bound_form(bound) -> dict:
    """A bound of limits.toml in one shape: {"range": [lo, hi]} (endpoints numbers or expressions of other keys),
    {"bool"}, {"object"}, {"one_of": [...]}, {"list": [lo, hi], "max_length", "min_length", "distinct"},
    {"length", "min", "max"} (a list of exactly `length` integers); "null": true where null is accepted."""
    if bound == "bool" or bound == "object":
        return {bound: True}
    if isinstance(bound, list):
        return {"range": bound}
    if isinstance(bound, Mapping):
        return dict(bound)
    raise ManifestError(f"bad bound {bound!r}", file=f"manifests/{LIMITS_FILE}")


def is_integer_range(lo, hi) -> bool:
    """Whether a range bounds integers: either numeric endpoint is an integer (the other may be an expression)."""
    return any(_is_int(e) for e in (lo, hi)) or not any(_is_number(e) for e in (lo, hi))


def check_value(field: str, value, bound, *, file: str, env: Mapping | None = None) -> None:
    """One value against one bound of limits.toml (see its header for the forms). An endpoint that is an expression
    of other keys is checked only with `env` (the part's keys, themselves checked first); a key it names that the
    config lacks leaves that endpoint unchecked."""
    form = bound_form(bound)

    def bad(why: str) -> ManifestError:
        return ManifestError(f"{field} = {_show(value)}: {why} (bounds: manifests/limits.toml, docs/LIMITS.md)",
                             file=file)

    if value is None and form.get("null"):
        return
    if form.get("bool"):
        if not isinstance(value, bool):
            raise bad("must be true or false")
    elif form.get("object"):
        if not isinstance(value, Mapping):
            raise bad("must be an object")
    elif "one_of" in form:
        if isinstance(value, (list, dict)) or value not in form["one_of"] or isinstance(value, bool) != any(
                isinstance(v, bool) for v in form["one_of"]):
            raise bad(f"must be one of {', '.join(map(repr, form['one_of']))}")
    elif "length" in form:  # a list of exactly `length` integers
        n, lo, hi = form["length"], form["min"], form["max"]
        if not (isinstance(value, list) and len(value) == n and all(_is_int(v) and lo <= v <= hi for v in value)):
            raise bad(f"must be a list of {n} integers in [{lo}, {hi}]")
    elif "list" in form:
        _check_list(value, form, bad, env)
    else:
        _check_number(value, form["range"], bad, env)


def _endpoints(lo_hi, env: Mapping | None) -> tuple:
    """(lo, hi) with expressions evaluated in `env` (None where there is no env or a key is absent)."""
    out = []
    for e in lo_hi:
        if isinstance(e, str):
            try:
                e = evaluate(e, env) if env is not None else None
            except MissingKey:
                e = None
        out.append(e)
    return tuple(out)


def _check_number(value, lo_hi, bad, env) -> None:
    if is_integer_range(*lo_hi):
        if not _is_int(value):
            raise bad("must be an integer")
    elif not _is_number(value):
        raise bad("must be a finite number")
    lo, hi = _endpoints(lo_hi, env)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise bad(f"outside [{_shown(lo_hi[0], lo)}, {_shown(lo_hi[1], hi)}]")


def _shown(text, value) -> str:
    return f"{text} = {value}" if isinstance(text, str) and value is not None else str(value if value is not None else text)


def _check_list(value, form: Mapping, bad, env) -> None:
    lo_hi = form["list"]
    longest, shortest = form.get("max_length", 4096), form.get("min_length", 0)
    if not isinstance(value, list) or not all(_is_int(v) for v in value):
        raise bad("must be a list of integers")
    if not shortest <= len(value) <= longest:
        raise bad(f"must hold {shortest} to {longest} entries")
    lo, hi = _endpoints(lo_hi, env)
    for i, v in enumerate(value):
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise bad(f"entry {i} ({v}) is outside [{_shown(lo_hi[0], lo)}, {_shown(lo_hi[1], hi)}]")
    if form.get("distinct") and len(set(value)) != len(value):
        raise bad(f"lists {next(v for v in value if value.count(v) > 1)} twice")


def _lookup(config: Mapping, key: str):
    """config[a][b]... for "a.b..." (a key inside nested config sections), _ABSENT where a level is absent."""
    where = config
    for name in key.split("."):
        if not isinstance(where, Mapping) or name not in where:
            return _ABSENT
        where = where[name]
    return where


def part_bounds(part: str, limits_path: Path) -> dict:
    """A part's bounds: those of the shared tables it includes (`include = [...]`: `[shared.NAME.bounds]`, the keys
    every text model's engine reads), then its own, which win."""
    doc = limits(limits_path)
    spec = doc.get("part", {}).get(part, {})
    out: dict = {}
    for name in spec.get("include", []):
        if name not in doc.get("shared", {}):
            raise ManifestError(f"part {part} includes unknown bounds {name!r}", file=f"manifests/{LIMITS_FILE}")
        out.update(doc["shared"][name].get("bounds", {}))
    out.update(spec.get("bounds", {}))
    return out


def _has_expression(bound) -> bool:
    form = bound_form(bound)
    return any(isinstance(e, str) for e in form.get("range", form.get("list", ())))


def check_bounds(part: str, config: Mapping, defaults: Mapping, *, prefix: str, file: str, limits_path: Path,
                 env: Mapping | None = None) -> None:
    """A part's config keys against their bounds in limits.toml. Without `env`: every key's type and its fixed
    range; with it (the part's keys, each checked): the ranges that are expressions of other keys."""
    for key, bound in part_bounds(part, limits_path).items():
        if env is not None and not _has_expression(bound):
            continue
        value = _lookup(config, key)
        if value is _ABSENT or (value is None and key in defaults):
            continue
        check_value(prefix + key, value, bound, file=file, env=env)


def check_relations(part: str, env: Mapping, *, prefix: str, file: str, limits_path: Path) -> None:
    """A part's relations in limits.toml, on `env` (config + defaults, with any keys the family rebinds, the
    part's schedules and `extra_layer_count`, the draft stages counted)."""
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


def run_checks(part: str, config: Mapping, env: Mapping, *, prefix: str, file: str, limits_path: Path) -> None:
    """A part's named checks (`checks = [...]` in limits.toml; kconvert/family/config_checks.py): the rules the engine
    applies to a config, run here with the same code."""
    from kconvert.family.config_checks import CHECKS

    for name in limits(limits_path).get("part", {}).get(part, {}).get("checks", []):
        if name not in CHECKS:
            raise ManifestError(f"unknown check {name!r} for part {part}", file=f"manifests/{LIMITS_FILE}")
        CHECKS[name](config, env, prefix=prefix, file=file)


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
