"""The engine's own rules on a config, run at bind time (limits.toml `checks = [...]` of a part; limits.run_checks):
the same functions the engine calls when it reads the config, so inspect, plan, shard and export refuse what the
engine would, with one line naming config.json and the key, before any work. Each check takes the part's config
section and its bound keys (`env`: config + defaults, schedules, the draft stages counted) and raises
ManifestError; a value of the wrong type was refused before, by the part's bounds."""

from __future__ import annotations

from collections.abc import Mapping

from kconvert.family.rope import read_rope, read_v4_ropes, v4_head_dims
from kconvert.family.v41_rules import check_engram_rows, roles


def rope(config: Mapping, env: Mapping, *, prefix: str, file: str) -> None:
    """The text model's rotary setting (rope_parameters / rope_scaling): a type the engine runs, finite numbers."""
    read_rope(config, prefix=prefix, file=file)


def v4_rope(config: Mapping, env: Mapping, *, prefix: str, file: str) -> None:
    """DeepSeek-V4 / V4.1's two rotary settings, each giving `qk_rope_head_dim` of `head_dim`."""
    rope_dim, head_dim = v4_head_dims(config)
    read_v4_ropes(config, rope_dim, head_dim, prefix=prefix, file=file)


def v41_roles(config: Mapping, env: Mapping, *, prefix: str, file: str) -> None:
    """Every compressed layer has a KV source and an indexer at or before it that line up; the candidate source runs
    an indexer (v41_rules.roles, what the engine's V41Config is built from)."""
    n = env["num_hidden_layers"]
    ratios = list(config.get("compress_ratios") or [])[:n]  # the schedule checked them: one integer per layer
    roles(ratios, set(config.get("kv_source_layer_ids") or []), set(config.get("index_source_layer_ids") or []),
          env.get("candidate_source_layer_id", -1), prefix=prefix, file=file)


def v41_engram_rows(config: Mapping, env: Mapping, *, prefix: str, file: str) -> None:
    """Each Engram layer's table holds the prime ranges its hashes reduce into (v41_rules.check_engram_rows)."""
    layers = env.get("engram_layer_ids") or []
    if not layers:
        return
    # the engine's defaults where a key is absent (engine/models/deepseek_v41/config.py)
    check_engram_rows(layers, env.get("engram_num_embeddings") or [], env.get("engram_vocab_size", 0),
                      env.get("engram_max_ngram_size", 4), env.get("engram_n_heads", 8), prefix=prefix, file=file)


CHECKS = {"rope": rope, "v4_rope": v4_rope, "v41_roles": v41_roles, "v41_engram_rows": v41_engram_rows}
