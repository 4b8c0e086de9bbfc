"""The engine's name for a stored tensor, where a family's released names differ from the module tree the
engine builds (DeepSeek-V4 stores `layers.3.attn.wq_a.weight`; the engine's module is transformers'
`model.layers.3.self_attn.q_a_proj`). The manifest says it per tensor: `engine` (a pattern with {L} / {E}),
else `reference` (transformers' name) where that names a whole tensor. Families without either (DeepSeek-V3,
Kimi) keep their names. The stored parts of a quantized weight (`X.weight_packed`, `X.weight_scale_inv` ...) and
its module's activation scale (nvfp4's `X.input_scale`) follow their weight."""

from __future__ import annotations

from kconvert.family.manifest import ModelMap, TensorInfo

# what a scheme stores beside or for `.weight` (nvfp4: `_scale_2`; compressed-tensors' `_global_scale`)
PART_SUFFIXES = ("_packed", "_scale_inv", "_scale", "_shape", "_scale_2", "_global_scale")
SIBLINGS = ("input_scale", "input_global_scale")  # a module's tensors beside its `weight` (nvfp4's activation scale)


def _pattern(info: TensorInfo) -> str | None:
    rule = info.rule
    if rule.engine:
        return (rule.part.engine_prefix or "") + rule.engine
    if rule.reference and "[" not in rule.reference:  # a slice of a fused tensor is no module of its own
        return (rule.part.engine_prefix or "") + rule.reference
    if rule.part.engine_rename:  # the part's modules keep the stored path under one prefix (V4.1: "model.")
        return (rule.part.engine_prefix or "") + rule.part.engine_rename + rule.pattern
    return None


def engine_name(names: ModelMap, stored: str) -> str:
    """`stored`'s name in the engine's module tree (itself when the manifest gives none)."""
    info, suffix = names.classify(stored), ""
    sibling = None
    if info is None:
        for s in PART_SUFFIXES:
            if stored.endswith(".weight" + s):
                info, suffix = names.classify(stored[: -len(s)]), s
                break
        for s in SIBLINGS:
            if stored.endswith("." + s):
                info, sibling = names.classify(stored[: -len(s)] + "weight"), s
                break
    pattern = _pattern(info) if info is not None else None
    if pattern is None:
        return stored
    if sibling is not None:
        pattern = pattern[: -len("weight")] + sibling
    if "{M}" in pattern:  # a draft stage's own path (DeepSeek-V4.1's DSpark: mtp.{M}.)
        pattern = pattern.replace("{M}", str(info.layer - info.rule.part.layer_count))
    return pattern.replace("{L}", str(info.layer)).replace("{E}", str(info.expert)) + suffix


def engine_keys(names: ModelMap, by_stored: dict) -> dict:
    """`by_stored` keyed by engine names (the same dict for a family that renames nothing). MTP blocks keep
    their names: they have no module in the engine."""
    if not names.renames:
        return by_stored
    return {engine_name(names, k): v for k, v in by_stored.items()}
