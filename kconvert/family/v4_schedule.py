"""DeepSeek-V4's layer schedule as a running model reads it: each decoder layer's attention kind and each
compressed kind's rate, and which layers route by hash. The engine (engine/models/deepseek_v4/config.py) and the planner's
KV-cache bytes (kconvert/plan/kv_bytes.py) both read it here.

The attention kind comes from `layer_types` (names, as transformers 5.23 writes them), else the released
`compress_ratios` (0 sliding, else the rate of CSA or HCA; a trailing MTP entry is ignored); rates from
`compress_rates` (or the legacy `compress_rate_csa` / `compress_rate_hca`). Hash routing: `mlp_layer_types
== "hash_moe"`, else the first `num_hash_layers` (default 3). Binding a checkpoint to its manifest has already
checked these fields (kconvert/family/schedule.py); a config that arrives otherwise is refused here in one line."""

from __future__ import annotations

from kconvert.errors import CheckpointError

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
RATIO_KIND = {0: SLIDING, 4: CSA, 128: HCA}  # the released compress_ratios values
DEFAULT_RATES = {CSA: 4, HCA: 128}


def compress_rates(c: dict) -> dict[str, int]:
    """CSA / HCA -> tokens per compressed entry."""
    rates = dict(DEFAULT_RATES)
    rates.update({k: int(v) for k, v in (c.get("compress_rates") or {}).items()})
    for kind, key in ((CSA, "compress_rate_csa"), (HCA, "compress_rate_hca")):
        if c.get(key) is not None:
            rates[kind] = int(c[key])
    return rates


def attention_kinds(c: dict, n: int, rates: dict[str, int]) -> tuple[str, ...]:
    """The attention kind of each of the n decoder layers (a config with no schedule is refused: transformers'
    fallback is not the released schedule)."""
    if c.get("layer_types"):
        kinds = list(c["layer_types"])
    elif c.get("compress_ratios") is not None:
        by_rate = {**RATIO_KIND, **{r: k for k, r in rates.items()}, 0: SLIDING}
        bad = [r for r in c["compress_ratios"] if r not in by_rate]
        if bad:
            raise CheckpointError(f"compress_ratios holds {bad[0]}, the rate of no attention kind", file="config.json")
        kinds = [by_rate[r] for r in c["compress_ratios"]]
    else:
        raise CheckpointError("config.json names no attention schedule (layer_types or compress_ratios)",
                              file="config.json")
    if len(kinds) < n or any(k not in (SLIDING, CSA, HCA) for k in kinds[:n]):
        raise CheckpointError(f"the attention schedule does not name {n} known layer kinds", file="config.json")
    return tuple(kinds[:n])


def hash_layers(c: dict, n: int) -> tuple[bool, ...]:
    """Whether each of the n decoder layers routes its experts by token id (a lookup table) instead of scores."""
    if c.get("mlp_layer_types"):
        return tuple(t == "hash_moe" for t in c["mlp_layer_types"][:n])
    k = int(c.get("num_hash_layers", 3))
    return tuple(L < k for L in range(n))
