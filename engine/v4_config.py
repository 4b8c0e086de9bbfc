"""DeepSeek-V4's own config keys, read from TextConfig.section (config.json as released or as transformers
writes it): the per-layer attention schedule, compress rates, the two rotary settings, mHC, hash routing.

Both spellings of the schedule are read: `layer_types` (names, as transformers 5.23 writes them) or the
released `compress_ratios` (0 sliding, else the rate of CSA or HCA; a trailing MTP entry is ignored); the rate
of each compressed kind comes from `compress_rates` (or the legacy `compress_rate_csa` / `compress_rate_hca`).
Hash routing covers `mlp_layer_types == "hash_moe"`, or the first `num_hash_layers` (default 3)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import RopeConfig, TextConfig, _rope
from kconvert.errors import CheckpointError

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
RATIO_KIND = {0: SLIDING, 4: CSA, 128: HCA}  # the released compress_ratios values
DEFAULT_RATES = {CSA: 4, HCA: 128}


@dataclass(frozen=True)
class V4Config:
    hidden: int
    heads: int
    head_dim: int
    rope_dim: int  # the trailing dims of every head that carry RoPE
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int  # sliding window (every layer), the query's own token included
    eps: float
    layer_kinds: tuple[str, ...]  # SLIDING | CSA | HCA per decoder layer
    rates: dict  # CSA / HCA -> tokens per compressed entry
    main_rope: RopeConfig  # sliding-only layers
    compress_rope: RopeConfig  # CSA / HCA layers, their compressors and the indexer
    index_heads: int
    index_head_dim: int
    index_topk: int
    hash_layers: tuple[bool, ...]
    hc_mult: int
    hc_iters: int
    hc_eps: float
    experts: int
    top_k: int
    routed_scale: float
    scoring: str  # sqrtsoftplus | sigmoid | softmax
    moe_inter: int
    swiglu_limit: float

    def rate(self, layer: int) -> int:
        return self.rates.get(self.layer_kinds[layer], 0)


def _kinds(c: dict, n: int, rates: dict) -> tuple[str, ...]:
    """From `layer_types`, else `compress_ratios` (a value names the kind whose rate it is, or the released
    0 / 4 / 128); a config with neither is refused (transformers' fallback is not the released schedule)."""
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


def _ropes(c: dict, rope_dim: int, head_dim: int) -> tuple[RopeConfig, RopeConfig]:
    """(main, compress): transformers' nested `rope_parameters` {main, compress}, or the flat form (YaRN
    keys from rope_parameters / rope_scaling apply to the compressed layers only, with attention_factor 1)."""
    rp = c.get("rope_parameters") or {}
    maxpos = c.get("max_position_embeddings", 4096)
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        main, comp = rp["main"], rp["compress"]
    else:
        flat = {k: v for k, v in {**(c.get("rope_scaling") or {}), **rp}.items() if k not in ("main", "compress")}
        main = {"rope_type": "default", "rope_theta": c.get("rope_theta", 10000.0)}
        comp = {**flat, "rope_theta": c.get("compress_rope_theta", 160000.0)}
        comp.setdefault("rope_type", comp.get("type", "default"))
        if comp["rope_type"] == "yarn":
            comp.setdefault("attention_factor", 1.0)
    for p in (main, comp):
        if int(head_dim * float(p.get("partial_rotary_factor", rope_dim / head_dim))) != rope_dim:
            raise CheckpointError("partial_rotary_factor disagrees with qk_rope_head_dim", file="config.json")
    return _rope({"rope_parameters": main, "max_position_embeddings": maxpos}), \
        _rope({"rope_parameters": comp, "max_position_embeddings": maxpos})


def v4_config(cfg: TextConfig) -> V4Config:
    c, n = cfg.section, cfg.num_layers
    try:
        head_dim = int(c.get("head_dim", 512))
        rope_dim = int(c.get("qk_rope_head_dim") or head_dim * float(c.get("partial_rotary_factor") or 64 / 512))
        rates = dict(DEFAULT_RATES)
        rates.update({k: int(v) for k, v in (c.get("compress_rates") or {}).items()})
        for kind, key in ((CSA, "compress_rate_csa"), (HCA, "compress_rate_hca")):
            if c.get(key) is not None:
                rates[kind] = int(c[key])
        if c.get("mlp_layer_types"):
            hashed = tuple(t == "hash_moe" for t in c["mlp_layer_types"][:n])
        else:
            k = int(c.get("num_hash_layers", 3))
            hashed = tuple(L < k for L in range(n))
        main, comp = _ropes(c, rope_dim, head_dim)
        return V4Config(
            hidden=cfg.hidden_size, heads=cfg.num_heads, head_dim=head_dim, rope_dim=rope_dim,
            q_lora_rank=int(c["q_lora_rank"]), o_groups=int(c.get("o_groups", 8)),
            o_lora_rank=int(c.get("o_lora_rank", 1024)), window=int(c.get("sliding_window", 128)),
            eps=cfg.rms_norm_eps, layer_kinds=_kinds(c, n, rates), rates=rates, main_rope=main, compress_rope=comp,
            index_heads=int(c.get("index_n_heads", 64)), index_head_dim=int(c.get("index_head_dim", 128)),
            index_topk=int(c.get("index_topk", 512)), hash_layers=hashed, hc_mult=int(c.get("hc_mult", 4)),
            hc_iters=int(c.get("hc_sinkhorn_iters", 20)), hc_eps=float(c.get("hc_eps", 1e-6)),
            experts=cfg.n_routed_experts, top_k=cfg.experts_per_token, routed_scale=cfg.routed_scaling_factor,
            scoring=c.get("scoring_func", "sqrtsoftplus"), moe_inter=cfg.moe_intermediate_size,
            swiglu_limit=float(c.get("swiglu_limit", 10.0)),
        )
    except KeyError as e:
        raise CheckpointError(f"config.json lacks {e.args[0]!r} needed by the engine", file="config.json") from None
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"a DeepSeek-V4 config value has the wrong type ({e})", file="config.json") from None
