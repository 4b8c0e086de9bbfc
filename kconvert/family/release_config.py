"""config.json in the release's own spelling: what `export` and `shard` write beside their tensors, whatever spelling
the source came in. Serving engines read the release's keys and nothing else (docs/EXPORT.md "Config keys as each
consumer reads them"): a transformers `save_pretrained` drops DeepSeek-V3's routing keys (`topk_method`,
`scoring_func`: vLLM then fails on `e_score_correction_bias`, or routes by softmax where the gate has no bias) and
writes DeepSeek-V4's schedule as `layer_types` / `mlp_layer_types: hash_moe`, which vLLM's V4 config refuses.

The family's manifest says what its release writes (data; the one place a family's spelling is decided):
- `[family.release_config]`: top-level keys with the release's values (Kimi-K2.5's `architectures`, the class name
  vLLM and SGLang register; transformers writes `Kimi_K25ForConditionalGeneration`);
- `[part.family.release_text_config]` (its text model's trait): `spelling`, a rewrite of transformers' keys into
  the release's (SPELLINGS), and `defaults`, keys the release always writes, set where the source has none.
"""

from __future__ import annotations

import copy

from kconvert.errors import CheckpointError
from kconvert.family import v4_schedule

# the release's YaRN keys (DeepSeek's `rope_scaling`); transformers adds rope_theta / partial_rotary_factor per type
_ROPE_DROPPED = ("rope_theta", "partial_rotary_factor", "attention_factor", "rope_type")


def deepseek_v4(text: dict) -> dict:
    """DeepSeek-V4's text config in DeepSeek's spelling: the attention schedule as `compress_ratios` (one rate per
    layer, 0 for sliding only, and a 0 per MTP block as released), hash routing as `num_hash_layers`, RoPE as
    `qk_rope_head_dim`, `rope_theta` / `compress_rope_theta` and the compressed layers' YaRN as `rope_scaling`;
    transformers' `layer_types`, `mlp_layer_types`, `rope_parameters` and `partial_rotary_factor` dropped (vLLM's
    config validates `mlp_layer_types` against its own layer names and refuses `hash_moe`). `compress_rates` stays only
    where its rates are not the release's 4 / 128 (kconvert reads it; the release has none)."""
    out = dict(text)
    n = int(out["num_hidden_layers"])
    rates = v4_schedule.compress_rates(out)
    if out.get("compress_ratios") is None or out.get("layer_types"):
        kinds = v4_schedule.attention_kinds(out, n, rates)
        rate = {v4_schedule.SLIDING: 0, **rates}
        out["compress_ratios"] = [rate[k] for k in kinds] + [0] * int(out.get("num_nextn_predict_layers") or 0)
    hashed = v4_schedule.hash_layers(out, n)
    count = sum(hashed)
    if any(hashed[count:]):
        raise CheckpointError("hash-routed layers that are not the first ones (mlp_layer_types) have no spelling in "
                              "DeepSeek's config (num_hash_layers counts the first N)", file="config.json")
    out["num_hash_layers"] = count
    rope = out.get("rope_parameters") or {}
    if out.get("qk_rope_head_dim") is None:
        factor = out.get("partial_rotary_factor") or (rope.get("main") or {}).get("partial_rotary_factor")
        if factor is None:
            raise CheckpointError("the RoPE width is named nowhere (qk_rope_head_dim, partial_rotary_factor)",
                                  file="config.json")
        out["qk_rope_head_dim"] = int(int(out["head_dim"]) * float(factor))
    if isinstance(rope.get("main"), dict):
        out.setdefault("rope_theta", rope["main"].get("rope_theta"))
    compress = rope.get("compress") if isinstance(rope.get("compress"), dict) else None if "main" in rope else rope
    if compress:
        out.setdefault("compress_rope_theta", compress.get("rope_theta"))
        kind = compress.get("rope_type", compress.get("type", "default"))
        if out.get("rope_scaling") is None and kind != "default":
            out["rope_scaling"] = {**{k: v for k, v in compress.items() if k not in _ROPE_DROPPED}, "type": kind}
    for key in ("layer_types", "mlp_layer_types", "rope_parameters", "partial_rotary_factor"):
        out.pop(key, None)
    if rates == v4_schedule.DEFAULT_RATES:
        out.pop("compress_rates", None)
    return out


SPELLINGS = {"deepseek_v4": deepseek_v4}


def release_config(config: dict, family: dict) -> dict:
    """`config` (config.json as the source has it) in the release's spelling, per the family's manifest (a new dict)."""
    out = copy.deepcopy(config)
    out.update(copy.deepcopy((family.get("release_config") or {})))
    spec = family.get("release_text_config") or {}
    key = family.get("text_config", ".")
    text = out if key == "." else out.get(key)
    if not isinstance(text, dict):
        return out
    spelling = spec.get("spelling")
    if spelling:
        text = SPELLINGS[spelling](text)
    for k, v in (spec.get("defaults") or {}).items():
        text.setdefault(k, copy.deepcopy(v))
    if key == ".":
        return text
    out[key] = text
    return out
