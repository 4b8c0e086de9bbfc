"""Every bound of manifests/limits.toml tried, its cases generated from the bound itself (issue 55): each key of each
part gets values outside its range and values of the wrong type (a string for an int, 4.0, true, a list, null where
the part gives no default), set in a released config where that part applies; bind (what inspect, plan, shard, export,
load and the engine run first) refuses each in one line naming config.json and the key's path. A part of limits.toml
that no config here binds, and a key the engine reads that limits.toml does not bound, fail the tests below, so a new
key or part cannot go untried."""

from __future__ import annotations

import copy
import math

import pytest

from config_cases import Recorded, engine_build, example_configs, tiny_configs
from kconvert.errors import ManifestError, MissingKey
from kconvert.family.expr import evaluate
from kconvert.family.limits import LIMITS_FILE, bound_form, is_integer_range, limits, part_bounds
from kconvert.family.manifest import bind, manifests_dir

LIMITS = manifests_dir() / LIMITS_FILE


def _hosts() -> dict[str, tuple[str, dict, object]]:
    """{part name: (config name, config, the bound part)}: the first released config binding each part."""
    out = {}
    for name, config in example_configs().items():
        for part in bind(config).parts:
            out.setdefault(part.name, (name, config, part))
    return out


HOSTS = _hosts()


def _endpoint(e, env):
    if not isinstance(e, str):
        return e
    try:
        return evaluate(e, env)
    except MissingKey:
        return None


def _out_of_bounds(form: dict, env) -> list:
    """Values of the right type outside the bound."""
    if "range" in form:
        lo, hi = (_endpoint(e, env) for e in form["range"])
        step = 1 if is_integer_range(*form["range"]) else None
        out = []
        if lo is not None:
            out.append(lo - 1 if step else lo - abs(lo) - 1.0)
        if hi is not None:
            out.append(hi + 1 if step else hi + abs(hi) + 1.0)
        return out
    if "one_of" in form:
        return ["no-such-kind"]
    if "length" in form:
        return [[form["min"] - 1] * form["length"], [form["min"]] * (form["length"] + 1)]
    if "list" in form:
        lo, hi = (_endpoint(e, env) for e in form["list"])
        out = [[hi + 1]] if hi is not None else []
        out += [[lo - 1]] if lo is not None else []
        out.append([lo if lo is not None else 0] * (form.get("max_length", 4096) + 1))
        if form.get("min_length"):
            out.append([])
        if form.get("distinct") and lo is not None and hi is not None and hi > lo:
            out.append([lo, lo])
        return out
    return []  # bool, object: only a wrong type is out of bounds


def _wrong_types(form: dict, nullable: bool) -> list:
    """Values of another type than the bound takes."""
    none = [] if nullable else [None]
    if form.get("bool"):
        return ["true", 1] + none
    if form.get("object"):
        return [5, "x", [1]] + none
    if "one_of" in form:
        return [5, ["silu"], {"a": 1}] + none
    if "length" in form or "list" in form:
        lo = form.get("min", form.get("list", [0])[0])
        lo = lo if isinstance(lo, int) else 0
        return ["x", 5, [str(lo)], [float(lo) + 0.5], [True]] + none
    if is_integer_range(*form["range"]):
        return ["4", 4.0, True, [4], {"a": 4}] + none
    return ["1.0", True, float("inf"), float("nan"), [1.0]] + none


def _cases():
    for part_name in sorted(limits(LIMITS).get("part", {})):
        if part_name not in HOSTS:
            continue  # test_every_part_is_tried names it
        host, config, part = HOSTS[part_name]
        env = part.env()
        for key, bound in part_bounds(part_name, LIMITS).items():
            form = bound_form(bound)
            nullable = bool(form.get("null")) or key in part.defaults
            for kind, values in (("out of bounds", _out_of_bounds(form, env)), ("wrong type", _wrong_types(form, nullable))):
                for value in values:
                    yield pytest.param(host, part.section, key, value, id=f"{part_name}:{key}:{kind}:{_short(value)}")


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 24 else r[:21] + "..."


def _set(config: dict, section: str, key: str, value) -> dict:
    config = copy.deepcopy(config)
    where = config if section == "." else config[section]
    *heads, last = key.split(".")
    for h in heads:
        if not isinstance(where.get(h), dict):
            where[h] = {}
        where = where[h]
    where[last] = value
    return config


CASES = list(_cases())


@pytest.mark.parametrize("host, section, key, value", CASES)
def test_each_bound_refuses_its_generated_values(host, section, key, value):
    config = _set(example_configs()[host], section, key, value)
    path = key if section == "." else f"{section}.{key}"
    with pytest.raises(ManifestError) as e:
        bind(config)
    line = e.value.one_line()
    assert line.startswith("config.json: ") and path in line and "Traceback" not in line, line
    assert "\n" not in line


def test_every_part_is_tried():
    """Every part limits.toml bounds is bound by a released config here (else its keys would go untried)."""
    assert not set(limits(LIMITS).get("part", {})) - set(HOSTS), set(limits(LIMITS)["part"]) - set(HOSTS)
    assert len(CASES) > 600, len(CASES)


@pytest.mark.parametrize("host", sorted(example_configs()))
def test_the_released_configs_bind(host):
    bind(example_configs()[host])


QUANT_HOSTS = {"weight_block_size": ("deepseek-v4-flash", ("quantization_config",)),
               "group_size": ("kimi-k3", ("text_config", "quantization_config", "config_groups", "*", "weights"))}


@pytest.mark.parametrize("key", sorted(limits(LIMITS)["quantization"]))
def test_quantization_bounds_refuse_their_generated_values(key):
    host, path = QUANT_HOSTS[key]
    form = bound_form(limits(LIMITS)["quantization"][key])
    for value in _out_of_bounds(form, {}) + [v for v in _wrong_types(form, True) if v is not None]:
        config = copy.deepcopy(example_configs()[host])
        where = config
        for p in path:
            where = next(iter(where.values())) if p == "*" else where[p]
        where[key] = value
        with pytest.raises(ManifestError, match=f"{path[-1]}.{key} = "):
            bind(config)


# --- every key the engine reads is bounded ---------------------------------------------------------------------------

# Keys the engine reads that other code checks (not limits.toml's bounds): the family's choice, the quantization
# config (limits.check_quantization), the rotary settings' inner keys (the `rope` checks: kconvert/family/rope.py).
CHECKED_ELSEWHERE = ("architectures", "model_type", "quantization_config", "rope_parameters.", "rope_scaling.",
                     "compress_rates.")


def _schedule_keys(part) -> set[str]:
    """The config keys a part's schedules read (values, names, counts, member lists, positions: kconvert/family/schedule.py
    checks them)."""
    from kconvert.family.families import read_toml

    spec = read_toml(manifests_dir() / "parts" / f"{part.name}.toml")
    out = set()
    for s in spec.get("schedules", {}).values():
        out |= {s[k] for k in ("values_key", "names_key", "count_key", "position_in") if k in s}
        out |= set((s.get("members") or {}).values())
    return out


def _section_key(names, path: str) -> tuple[str, str]:
    """(config section, key within it) of a read key path: `text_config.hc_eps` -> (text_config, hc_eps)."""
    head, _, rest = path.partition(".")
    if rest and any(p.section == head for p in names.parts):
        return head, rest
    return ".", path


def _bounded(names, path: str) -> bool:
    """Whether config key `path` has a bound or a schedule in a part bound to its section, or another check."""
    section, key = _section_key(names, path)
    if key.startswith(CHECKED_ELSEWHERE) or (section == "." and any(p.section == key for p in names.parts)):
        return True
    return any(p.section == section and (key in part_bounds(p.name, LIMITS) or key in _schedule_keys(p))
               for p in names.parts)


@pytest.mark.parametrize("preset", sorted(tiny_configs()))
def test_engine_reads_only_bounded_keys(preset, monkeypatch):
    """Every config key the engine reads while building a model (its config reading, every layer, draft stage and the
    vision tower) has a bound in limits.toml (or a schedule, or the quantization / rotary checks): a key read without
    one fails here, naming it."""
    from engine import config as engine_config
    from kconvert.family.manifest import ModelMap

    config = Recorded(tiny_configs()[preset])
    log = config.log
    with_defaults = ModelMap.with_defaults

    def recorded_defaults(self, sub, section):
        return Recorded(with_defaults(self, sub, section), "" if section == "." else f"{section}.", log)

    def logged(method):
        def read(self, key, *args):
            log.add(f"{self.prefix}{key}")
            return method(self, key, *args)
        return read

    monkeypatch.setattr(ModelMap, "with_defaults", recorded_defaults)
    monkeypatch.setattr(engine_config.Reads, "get", logged(engine_config.Reads.get))
    monkeypatch.setattr(engine_config.Reads, "__getitem__", logged(engine_config.Reads.__getitem__))
    engine_build(config)
    names = bind(tiny_configs()[preset])
    unbounded = sorted(path for path in log if not _bounded(names, path))
    assert not unbounded, f"{preset}: the engine reads {unbounded} with no bound in manifests/limits.toml"
