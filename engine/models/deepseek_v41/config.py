"""DeepSeek-V4.1's own config keys (TextConfig.section, the composite's `text_config`), and who reads whose state.

Compression is by role: `compress_ratios[L]` (0: window only) says how many tokens make one compressed entry on
layer L; only `kv_source_layer_ids` compute entries, every other compressed layer reads those of the last source at
or before it. Only `index_source_layer_ids` run an indexer; an indexer scores the keys of the last layer at or before
it that is both a KV source and an indexer (a source that indexes projects its own keys), and a compressed layer
without an indexer attends to the entries the last indexer at or before it chose. Indexers after
`candidate_source_layer_id` score only inside the blocks of entries that layer's indexer found best. Both references
(mlx-vlm's and mlx-lm's deepseek_v41) keep this state as "the last one written", so a layer may attend to one source's
entries through a choice scored on another's keys: that runs as they run it. What they cannot run, or would run as no
causal model (state of different rates read by each other's positions), is refused in one line, by bind first
(kconvert/family/v41_rules.py holds the rule, and limits.toml's `checks` run it when a config is bound)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import RopeConfig, TextConfig
from engine.models.deepseek_v4.config import _ropes
from kconvert.errors import CheckpointError, KConvertError
from kconvert.family.v41_rules import roles


@dataclass(frozen=True)
class V41Config:
    hidden: int
    heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int
    eps: float
    ratios: tuple[int, ...]  # per decoder layer: tokens per compressed entry (0: window only)
    entries_from: tuple[int | None, ...]  # per layer: the KV source whose entries it attends to
    choice_from: tuple[int | None, ...]  # per layer: the indexer whose top-k it attends to
    keys_from: tuple[int | None, ...]  # per indexer layer: the layer whose index keys it scores
    kv_sources: frozenset
    indexers: frozenset
    candidate_source: int  # -1: none (or no indexer there that scores anything)
    candidate_blocks: int
    candidate_block_size: int
    index_heads: int
    index_head_dim: int
    index_topk: int
    main_rope: RopeConfig
    compress_rope: RopeConfig
    hc_mult: int
    hc_iters: int
    hc_eps: float
    experts: int
    top_k: int
    routed_scale: float
    norm_topk: bool
    moe_inter: int
    swiglu_limit: float
    scoring: str
    engram_layers: tuple[int, ...]
    engram_rows: tuple[int, ...]
    engram_max_ngram: int
    engram_heads: int
    engram_head_dim: int
    engram_vocab: int
    engram_compressed_vocab: int
    engram_pad_token: int

    def attends(self, layer: int) -> bool:
        """Whether a layer attends to compressed entries (else to its window alone)."""
        T = self.choice_from[layer]
        return T is not None and self.keys_from[T] is not None

    def uses_candidates(self, layer: int) -> bool:
        return self.candidate_blocks > 0 and 0 <= self.candidate_source < layer and layer in self.indexers

    def engram_slot(self, layer: int) -> int:
        return self.engram_layers.index(layer) if layer in self.engram_layers else -1


def _ids(c, key: str, n: int) -> list[int]:
    v = c.get(key) or []
    if not isinstance(v, list) or not all(isinstance(i, int) and 0 <= i < n for i in v):
        raise CheckpointError(f"{c.prefix}{key} must list decoder layers 0..{n - 1}", file=c.file)
    return v


def v41_config(cfg: TextConfig) -> V41Config:
    c, n = cfg.reads(), cfg.num_layers
    try:
        head_dim = int(c.get("head_dim", 512))
        rope_dim = int(c["qk_rope_head_dim"])
        ratios = [int(r) for r in list(c["compress_ratios"])[:n]]
        sources, indexers = set(_ids(c, "kv_source_layer_ids", n)), set(_ids(c, "index_source_layer_ids", n))
        candidate = int(c.get("candidate_source_layer_id", -1))
        entries, choice, keys, candidate = roles(ratios, sources, indexers, candidate, prefix=c.prefix,
                                                   file=c.file)
        main, comp = _ropes(c, rope_dim, head_dim, c.prefix, c.file)
        engram = _ids(c, "engram_layer_ids", n)
        return V41Config(
            hidden=cfg.hidden_size, heads=cfg.num_heads, head_dim=head_dim, rope_dim=rope_dim,
            q_lora_rank=int(c["q_lora_rank"]), o_groups=int(c.get("o_groups", 8)),
            o_lora_rank=int(c.get("o_lora_rank", 1024)), window=int(c.get("sliding_window", 128)), eps=cfg.rms_norm_eps,
            ratios=tuple(ratios), entries_from=entries, choice_from=choice, keys_from=keys,
            kv_sources=frozenset(sources), indexers=frozenset(indexers), candidate_source=candidate,
            candidate_blocks=int(c.get("candidate_topk_blocks", 0)), candidate_block_size=int(c.get("candidate_block_size", 1)),
            index_heads=int(c.get("index_n_heads", 32)), index_head_dim=int(c.get("index_head_dim", 128)),
            index_topk=int(c.get("index_topk", 512)), main_rope=main, compress_rope=comp,
            hc_mult=int(c.get("hc_mult", 4)), hc_iters=int(c.get("hc_sinkhorn_iters", 20)),
            hc_eps=float(c.get("hc_eps", 1e-6)), experts=cfg.n_routed_experts, top_k=cfg.experts_per_token,
            routed_scale=cfg.routed_scaling_factor, norm_topk=bool(c.get("norm_topk_prob", True)),
            moe_inter=cfg.moe_intermediate_size, swiglu_limit=float(c.get("swiglu_limit", 10.0)),
            scoring=c.get("scoring_func", "sqrtsoftplus"), engram_layers=tuple(engram),
            engram_rows=tuple(int(r) for r in (c.get("engram_num_embeddings") or [])[:len(engram)]),
            engram_max_ngram=int(c.get("engram_max_ngram_size", 4)), engram_heads=int(c.get("engram_n_heads", 8)),
            engram_head_dim=int(c.get("engram_head_dim", 256)), engram_vocab=int(c.get("engram_vocab_size", 0)),
            engram_compressed_vocab=int(c.get("engram_compressed_vocab_size", 0)),
            engram_pad_token=int(c.get("engram_pad_token_id", 0)),
        )
    except (KConvertError, KeyError, TypeError, ValueError) as e:
        raise c.error(e) from None
