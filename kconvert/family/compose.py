"""How a family manifest composes its parts (kconvert/family/manifest.py binds them): which `[[parts]]` entry
applies to a config, and the family traits a text part brings (`[part.family]`), so a family over another
model's text (Kimi over DeepSeek-V4) takes that model's parts and traits instead of copying them."""

from __future__ import annotations

from kconvert.family.rule_names import stored_stage_count


def part_applies(entry: dict, sub: dict) -> bool:
    """Whether a family's `[[parts]]` entry applies to its config section `sub`: `if_config_has` (a key),
    `if_config_set` / `unless_config_set` (a key with a value that is not null, false, 0 or empty: a layout a list
    switches on, DeepSeek-V4-0731's `dspark_target_layer_ids`), `if_model_type` / `unless_model_type` (the
    section's model_type)."""
    if "if_config_has" in entry and entry["if_config_has"] not in sub:
        return False
    if "if_config_set" in entry and not sub.get(entry["if_config_set"]):
        return False
    if "unless_config_set" in entry and sub.get(entry["unless_config_set"]):
        return False
    if "if_model_type" in entry and sub.get("model_type") != entry["if_model_type"]:
        return False
    return not ("unless_model_type" in entry and sub.get("model_type") == entry["unless_model_type"])


def stage_count(entry: dict, names) -> int:
    """The draft stages an entry counts from the checkpoint's names (`stages_from_names`, a pattern such as
    "mtp.{M}.": DeepSeek-V4-0731 says num_nextn_predict_layers 1 for its 3 DSpark stages), else 0 (the config's)."""
    if names is None or "stages_from_names" not in entry:
        return 0
    return stored_stage_count(names, entry["stages_from_names"])


def stage_names(entries: list[dict], stages: int) -> list[str]:
    """Stored-name prefixes of `stages` draft stages under each entry's `stages_from_names` pattern: what a converted
    checkpoint's draft layers say of the count (the engine binds with them: it lists units, not names)."""
    return [e["stages_from_names"].replace("{M}", str(m)) for e in entries if "stages_from_names" in e
            for m in range(stages)]


def with_traits(family: dict, parts) -> dict:
    """The family's table with its parts' traits (`BoundPart.traits`) laid over it, tables merged key by key."""
    out = dict(family)
    for part in parts:
        for key, value in part.traits.items():
            out[key] = {**out.get(key, {}), **value} if isinstance(value, dict) else value
    return out
