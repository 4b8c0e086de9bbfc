"""DeepSeek-V4's own config keys, read from TextConfig.section (config.json as released or as transformers
writes it): the per-layer attention schedule and compress rates, the two rotary settings, mHC, hash routing.
The schedule (attention kinds, rates, hash layers) is read by kconvert/family/v4_schedule.py, which the
planner's KV bytes read too."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import RopeConfig, TextConfig
from kconvert.errors import KConvertError
from kconvert.family.rope import read_v4_ropes
from kconvert.family.v4_schedule import CSA, HCA, SLIDING, attention_kinds, compress_rates, hash_layers  # noqa: F401 (CSA, HCA, SLIDING: engine API)


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


def _ropes(c: dict, rope_dim: int, head_dim: int, prefix: str = "", file: str = "config.json"
           ) -> tuple[RopeConfig, RopeConfig]:
    """(main, compress): kconvert/family/rope.py's reading (bind checks configs with the same code)."""
    return read_v4_ropes(c, rope_dim, head_dim, prefix=prefix, file=file)


def v4_config(cfg: TextConfig) -> V4Config:
    c, n = cfg.reads(), cfg.num_layers
    try:
        head_dim = int(c.get("head_dim", 512))
        rope_dim = int(c.get("qk_rope_head_dim") or head_dim * float(c.get("partial_rotary_factor") or 64 / 512))
        rates = compress_rates(c)
        hashed = hash_layers(c, n)
        main, comp = _ropes(c, rope_dim, head_dim, c.prefix, c.file)
        return V4Config(
            hidden=cfg.hidden_size, heads=cfg.num_heads, head_dim=head_dim, rope_dim=rope_dim,
            q_lora_rank=int(c["q_lora_rank"]), o_groups=int(c.get("o_groups", 8)),
            o_lora_rank=int(c.get("o_lora_rank", 1024)), window=int(c.get("sliding_window", 128)),
            eps=cfg.rms_norm_eps, layer_kinds=attention_kinds(c, n, rates), rates=rates, main_rope=main, compress_rope=comp,
            index_heads=int(c.get("index_n_heads", 64)), index_head_dim=int(c.get("index_head_dim", 128)),
            index_topk=int(c.get("index_topk", 512)), hash_layers=hashed, hc_mult=int(c.get("hc_mult", 4)),
            hc_iters=int(c.get("hc_sinkhorn_iters", 20)), hc_eps=float(c.get("hc_eps", 1e-6)),
            experts=cfg.n_routed_experts, top_k=cfg.experts_per_token, routed_scale=cfg.routed_scaling_factor,
            scoring=c.get("scoring_func", "sqrtsoftplus"), moe_inter=cfg.moe_intermediate_size,
            swiglu_limit=float(c.get("swiglu_limit", 10.0)),
        )
    except (KConvertError, KeyError, TypeError, ValueError) as e:
        raise c.error(e) from None
