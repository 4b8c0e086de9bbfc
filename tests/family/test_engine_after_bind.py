"""The engine refuses no config that bind accepted (issue 55): random changes of the tiny presets' configs, each value
drawn inside its bound of manifests/limits.toml (nulls where a part gives a default, layer ids, token ids, kinds), are
bound as inspect and shard bind them; every one bind accepts is then read by the engine as a conversion would be
(tests/family/config_cases.engine_build: its config reading, every layer and draft stage, the vision tower, a DSpark
drafter's settings), which must raise nothing. A rule the engine applies that bind does not (a finished conversion
the engine then refuses) fails here, naming the change."""

from __future__ import annotations

import random

import pytest

from config_cases import engine_build, tiny_configs
from kconvert.errors import KConvertError, ManifestError, MissingKey
from kconvert.family.expr import evaluate
from kconvert.family.limits import LIMITS_FILE, bound_form, is_integer_range, part_bounds
from kconvert.family.manifest import bind, manifests_dir

LIMITS = manifests_dir() / LIMITS_FILE
ROUNDS = 40  # changed configs per preset
SEED = 55


def _end(e, env):
    if not isinstance(e, str):
        return e
    try:
        return evaluate(e, env)
    except MissingKey:
        return None


def _draw(rng: random.Random, form: dict, current, env, nullable: bool):
    """A value inside the bound, near the config's own where it has one (a 10^5-layer model is valid but not cheap)."""
    if "schedule" in form:
        return _schedule(rng, form, env)
    if nullable and rng.random() < 0.15:
        return None
    if form.get("bool"):
        return rng.random() < 0.5
    if "one_of" in form:
        return rng.choice(form["one_of"])
    if form.get("object"):
        return current if isinstance(current, dict) else {}
    if "length" in form:
        return [rng.randint(form["min"], min(form["max"], form["min"] + 4)) for _ in range(form["length"])]
    if "list" in form:
        lo, hi = (_end(e, env) for e in form["list"])
        lo, hi = 0 if lo is None else lo, (lo or 0) + 16 if hi is None else hi
        hi = min(hi, lo + 1 << 20)
        n = rng.randint(0 if not form.get("min_length") else form["min_length"], min(4, form.get("max_length", 4)))
        pool = list(range(lo, min(hi, lo + 64) + 1))
        return rng.sample(pool, min(n, len(pool))) if form.get("distinct") else [rng.choice(pool) for _ in range(n)]
    lo, hi = (_end(e, env) for e in form["range"])
    if is_integer_range(*form["range"]):
        base = current if isinstance(current, int) and not isinstance(current, bool) else (lo if lo is not None else 0)
        lo = base - 8 if lo is None else lo
        hi = base + 8 if hi is None else hi
        picks = [lo, min(hi, lo + 1), base, rng.randint(max(lo, base // 2), max(lo, min(hi, base * 2 + 2)))]
        return min(max(rng.choice(picks), lo), hi)
    base = current if isinstance(current, (int, float)) and not isinstance(current, bool) else (lo or 0.0)
    lo, hi = (0.0 if lo is None else lo), (10.0 if hi is None else hi)
    return min(max(rng.choice([lo, base, rng.uniform(lo, min(hi, abs(base) * 4 + 1))]), lo), hi)


def _keys(config: dict) -> list[tuple[str, str, dict, object]]:
    """(section, key, bound form or schedule, part) of every bounded key and every schedule key (layer roles, ratios,
    kinds: kconvert/family/schedule.py) of the parts bound to `config`."""
    from kconvert.family.families import read_toml

    out = []
    for part in bind(config).parts:
        for key, bound in part_bounds(part.name, LIMITS).items():
            out.append((part.section, key, bound_form(bound), part))
        for spec in read_toml(manifests_dir() / "parts" / f"{part.name}.toml").get("schedules", {}).values():
            for role in ("values_key", "names_key", "count_key", "position_in"):
                if role in spec:
                    out.append((part.section, spec[role], {"schedule": role, **spec}, part))
            for path in (spec.get("members") or {}).values():
                out.append((part.section, path, {"schedule": "members", **spec}, part))
    return out


def _schedule(rng: random.Random, spec: dict, env):
    """A schedule's value of the right shape: ratios or kind names per layer, a count, a list of layer ids."""
    n = int(evaluate(spec["length"], env))
    role = spec["schedule"]
    if role == "values_key":
        values = [evaluate(v, env) for v in spec["values"]] + ([rng.randint(2, 8)] if "other_values_kind" in spec else [])
        return [rng.choice(values) for _ in range(n)]
    if role == "names_key":
        return [rng.choice(spec["kinds"]) for _ in range(int(evaluate(spec.get("names_length", spec["length"]), env)))]
    if role == "count_key":
        return rng.randint(0, n)
    base = int(spec.get("members_base", 0))
    return sorted(rng.sample(range(base, n + base), rng.randint(0, min(n, 4))))


def _get(config, section, key):
    where = config if section == "." else config.get(section, {})
    for k in key.split("."):
        if not isinstance(where, dict) or k not in where:
            return None
        where = where[k]
    return where


def _set(config, section, key, value):
    where = config if section == "." else config[section]
    *heads, last = key.split(".")
    for h in heads:
        if not isinstance(where.get(h), dict):
            where[h] = {}
        where = where[h]
    where[last] = value


def _changes(preset: str):
    rng = random.Random(f"{SEED}-{preset}")
    keys = _keys(tiny_configs()[preset])
    for i in range(ROUNDS):
        config, change = tiny_configs()[preset], {}
        for section, key, form, part in rng.sample(keys, rng.randint(1, 3)):
            value = _draw(rng, form, _get(config, section, key), part.env(), bool(form.get("null")) or key in part.defaults)
            _set(config, section, key, value)
            change[key if section == "." else f"{section}.{key}"] = value
        yield i, config, change


@pytest.mark.parametrize("preset", sorted(tiny_configs()))
def test_the_engine_runs_what_bind_accepts(preset):
    accepted = 0
    for i, config, change in _changes(preset):
        try:  # as shard binds a source: with the draft stages its names hold (the config's count, here)
            bind(config, draft_stages=bind(config).text.extra_layers)
        except ManifestError:
            continue  # refused before any work, in one line: what inspect and shard say
        accepted += 1
        try:
            engine_build(config)
        except KConvertError as e:
            pytest.fail(f"{preset} change {i} {change}: bind accepted it, the engine refused: {e.one_line()}")
        except Exception as e:  # noqa: BLE001 (any other failure is the engine's bug)
            pytest.fail(f"{preset} change {i} {change}: bind accepted it, the engine failed: {type(e).__name__}: {e}")
    assert accepted >= ROUNDS // 5, f"{preset}: only {accepted} of {ROUNDS} changes were accepted (draws too wild)"
