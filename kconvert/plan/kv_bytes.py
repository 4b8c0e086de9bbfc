"""KV-cache bytes per token for MLA + DSA models, as the serving engines store it.

Per decoder layer (MTP layers excluded: the converter drops them by default) a token keeps
- the MLA latent: `kv_lora_rank` compressed KV + `qk_rope_head_dim` rotary key, shared by all heads;
  - bf16: 2 * (kv_lora_rank + rope) bytes (1152 for 512 + 64);
  - fp8 as FlashMLA stores it: the latent in e4m3 with one float32 scale per 128 values, the rope
    part left in bf16: kv_lora_rank + 4 * ceil(kv_lora_rank / 128) + 2 * rope (656 for 512 + 64);
- the DSA lightning-indexer key (`index_head_dim`, one per token, shared by the indexer heads);
  - bf16: 2 * index_head_dim (256 for 128);
  - fp8 as vLLM stores it: index_head_dim + 4 * ceil(index_head_dim / 128) (132 for 128).
- `--kv-dtype fp8` (the default 8-bit cache): the fp8 latent above with the indexer keys in bf16 (656 + 256);
  `--kv-dtype fp8-ds`: DeepSeek-V3.2's serving layout, fp8 latent and fp8 indexer keys (656 + 132), for
  the most tokens per byte; `--kv-dtype int8`: the latent in int8 with one float32 scale per 128 values
  (amax / 127) and the rope part in bf16 (656), keys in bf16 (256). 8-bit indexer keys flip the DSA top-k
  selection wherever two scores are near a tie, and on the trained fixtures that costs more than the whole
  8-bit latent: docs/KV_CACHE.md has the measurements behind these choices.
Models without the indexer (DeepSeek-V3, Kimi-K2: no `index_topk`) have no indexer cache. DeepSeek-V4
(no latent; compressed entries, sliding windows, compressor state) is `compressed_kv_bytes`: an exact
per-layer formula (`KVBytes.layer_terms`, `context_bytes`, `max_context`), its host tier too;
DeepSeek-V4.1 (`v41_kv_bytes`) the same with entries and keys on the KV source layers only.
Kimi Linear / Kimi K3 (KDA + MLA layers) is `hybrid_kv_bytes`: MLA layers keep the latent row above per token;
KDA layers keep, per sequence whatever its length, a float32 state [heads, Dk, Dv] and their short convolutions'
last kernel-1 inputs (3 x heads x Dk, bf16), split over tp by heads (`KVBytes.on_tp`).

Under DeepSeek's tensor-parallel layout the latent is not split by heads (it has none): every rank holds
the whole latent and indexer cache of every sequence it serves: bytes per token *per rank*, whatever tp.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from kconvert.errors import UsageError
from kconvert.kv_rows import INDEX_CODE, KV_DTYPES, LATENT_CODE, row_bytes, v4_entry_bytes
from kconvert.family.v4_schedule import CSA, attention_kinds, compress_rates



@dataclass(frozen=True)
class KVBytes:
    dtype: str
    layers: int
    latent_bytes: int  # per token per layer
    indexer_bytes: int  # per token per layer
    cache: str = "mla"  # mla: one latent per token; compressed (V4): entries per rate, averaged over layers
    # compressed (V4) only, exact: per layer (rate, bytes per compressed entry, bytes per sequence, bytes per
    # entry the host tier keeps in host memory); rate 0 = sliding window only. A sequence of L >= 1 tokens
    # keeps sum(per_sequence + (L // rate) * per_entry), of which sum((L // rate) * host) in host memory.
    layer_terms: tuple = ()
    # per layer of layer_terms: whether its per-sequence bytes split over tp ranks (KDA states: by heads)
    split_over_tp: tuple = ()

    @property
    def per_layer(self) -> int:
        return self.latent_bytes + self.indexer_bytes

    @property
    def per_token(self) -> int:
        """Bytes per token per rank, all layers (for V4 the layer average, rounded up)."""
        return self.layers * self.per_layer

    @property
    def per_sequence(self) -> int:
        """Bytes a sequence keeps whatever its length (V4: each layer's sliding window and compressor state)."""
        return sum(t[2] for t in self.layer_terms)

    def context_bytes(self, context: int, part: str = "all") -> int:
        """Exact bytes of one sequence of `context` tokens on this rank; part "host" / "device": what the host
        tier keeps in host memory / on the device."""
        if not self.layer_terms:
            return context * self.per_token if part != "host" else 0
        if context <= 0:
            return 0
        total = 0
        for rate, entry, fixed, host in self.layer_terms:
            n = context // rate if rate else 0
            total += {"all": fixed + n * entry, "host": n * host, "device": fixed + n * (entry - host)}[part]
        return total

    def max_context(self, free: int, batch: int, host_free: int | None = None) -> int | None:
        """The longest context whose `batch` sequences fit in `free` bytes (with `host_free`: the host tier's
        device part in `free`, its host part in `host_free`)."""
        if not self.layer_terms:
            return max(free, 0) // (batch * self.per_token) if self.per_token else None

        def fits(n: int) -> bool:
            if host_free is None:
                return batch * self.context_bytes(n) <= free
            return batch * self.context_bytes(n, "device") <= free and batch * self.context_bytes(n, "host") <= host_free

        if not fits(1):
            return 0
        if all(t[0] == 0 for t in self.layer_terms):
            return None  # sliding windows only: any context
        lo, hi = 1, 2
        while fits(hi):
            lo, hi = hi, hi * 2
            if hi > 1 << 50:
                return None  # nothing grows here (host tier: the device part is per sequence only)
        while hi - lo > 1:  # the bytes grow with the context: bisect
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

    def stage(self, first: int, end: int) -> "KVBytes":
        """The KV of layers first..end-1 (a pipeline stage)."""
        return replace(self, layers=end - first, layer_terms=self.layer_terms[first:end],
                       split_over_tp=self.split_over_tp[first:end])

    def on_tp(self, tp: int) -> "KVBytes":
        """What one rank of `tp` keeps: the per-sequence bytes of the layers that split by heads, divided."""
        if not any(self.split_over_tp):
            return self
        terms = tuple((r, e, f // tp if split else f, h) for (r, e, f, h), split in zip(self.layer_terms, self.split_over_tp))
        return replace(self, layer_terms=terms, split_over_tp=())

    def to_json(self) -> dict:
        out = {**asdict(self), "bytes_per_token_per_layer": self.per_layer, "bytes_per_token": self.per_token,
               "replicated_across_tp": True}
        if self.layer_terms:
            out["bytes_per_sequence"] = self.per_sequence
        if self.cache == "hybrid":  # exact per kind: MLA rows per token, KDA states per sequence
            mla = [t for t in self.layer_terms if t[0]]
            out.update(mla_layers=len(mla), kda_layers=len(self.layer_terms) - len(mla),
                       mla_bytes_per_token=sum(t[1] for t in mla), kda_bytes_per_sequence=self.per_sequence)
        return out


def latent_bytes(kv_lora_rank: int, rope_dim: int, dtype: str) -> int:
    """The latent in `dtype`'s code (LATENT_CODE), the rope part always in bf16 (it carries the position)."""
    return row_bytes(kv_lora_rank, LATENT_CODE[dtype]) + 2 * rope_dim


def indexer_bytes(index_head_dim: int, dtype: str) -> int:
    """One indexer key under --kv-dtype `dtype` (its code: INDEX_CODE)."""
    return row_bytes(index_head_dim, INDEX_CODE[dtype]) if index_head_dim else 0


def kv_bytes(text_config: dict, dtype: str = "bf16") -> KVBytes:
    """The KV cache a text config implies (num_hidden_layers layers; MTP layers not counted)."""
    if dtype not in KV_DTYPES:
        raise UsageError(f"unknown --kv-cache-dtype {dtype!r} (choose from {', '.join(KV_DTYPES)})")
    tc = text_config
    if "kv_source_layer_ids" in tc:
        return v41_kv_bytes(tc, dtype)
    if "kv_lora_rank" not in tc and ("compress_ratios" in tc or "layer_types" in tc):
        return compressed_kv_bytes(tc, dtype)
    if isinstance(tc.get("linear_attn_config"), dict):
        return hybrid_kv_bytes(tc, dtype)
    index_dim = int(tc.get("index_head_dim") or 0) if tc.get("index_topk") else 0
    return KVBytes(
        dtype=dtype,
        layers=int(tc["num_hidden_layers"]),
        latent_bytes=latent_bytes(int(tc["kv_lora_rank"]), int(tc["qk_rope_head_dim"]), dtype),
        indexer_bytes=indexer_bytes(index_dim, dtype),
    )


def compressed_layers(tc: dict) -> list[tuple[int, bool]]:
    """DeepSeek-V4: each decoder layer's (compression rate, is CSA); rate 0 = sliding window only. The schedule
    as the engine reads it (kconvert/family/v4_schedule.py)."""
    rates = compress_rates(tc)
    return [(rates.get(k, 0), k == CSA) for k in attention_kinds(tc, int(tc["num_hidden_layers"]), rates)]


V4_STATE_BYTES = 4  # the compressors' running state is float32


def compressor_state_bytes(rate: int, dim: int, overlap: bool) -> int:
    """A compressor's running state per sequence: the projected kv and gate rows of the window still filling up
    (rate rows of width 2 * dim with the CSA overlap, else dim) and, for CSA, the last full window's first series."""
    width = 2 * dim if overlap else dim
    return V4_STATE_BYTES * (2 * rate * width + (2 * rate * dim if overlap else 0))


def compressed_kv_bytes(tc: dict, dtype: str) -> KVBytes:
    """DeepSeek-V4's cache as the engine keeps it (engine/models/deepseek_v4/cache.py). Per layer of rate m, for a sequence of L
    tokens: L // m compressed entries (`v4_entry_bytes`), on CSA layers also L // m indexer keys; every layer
    its last `sliding_window - 1` keys (a ring of K=V rows in the entry's code) and each compressor's state
    (`compressor_state_bytes`): the last two are per sequence, whatever L. `latent_bytes` / `indexer_bytes`
    are the per-token part averaged over the layers (rounded up); `layer_terms` is exact."""
    head, rope = int(tc["head_dim"]), int(tc.get("qk_rope_head_dim") or 0)
    entry = v4_entry_bytes(head, rope, LATENT_CODE[dtype])
    index_dim = int(tc.get("index_head_dim") or 128)
    key = indexer_bytes(index_dim, dtype)
    window = int(tc.get("sliding_window") or 128) - 1
    terms = []
    terms, latent, index = [], 0.0, 0.0
    for r, csa in compressed_layers(tc):
        fixed = window * entry
        if r:
            fixed += compressor_state_bytes(r, head, csa)
            latent += entry / r
        if csa:
            fixed += compressor_state_bytes(r, index_dim, True)
            index += key / r
        terms.append((r, entry + (key if csa else 0), fixed, entry if csa else 0))
    n = int(tc["num_hidden_layers"])
    return KVBytes(dtype=dtype, layers=n, latent_bytes=math.ceil(latent / n), indexer_bytes=math.ceil(index / n),
                   cache="compressed", layer_terms=tuple(terms))


def v41_kv_bytes(tc: dict, dtype: str) -> KVBytes:
    """DeepSeek-V4.1's cache as the engine keeps it (engine/models/deepseek_v41/cache.py): every layer its sliding window's ring; a
    KV source of ratio r its L // r entries and its compressor's float32 rows of the group still filling up (kv and
    gate, r rows each); a source that also indexes, L // r index keys (and the same running rows, at the key width,
    which the engine keeps though a key needs none). Layers that read another layer's entries keep nothing more."""
    head, rope = int(tc["head_dim"]), int(tc.get("qk_rope_head_dim") or 0)
    entry = v4_entry_bytes(head, rope, LATENT_CODE[dtype])
    index_dim = int(tc.get("index_head_dim") or 128)
    key = indexer_bytes(index_dim, dtype)
    window = int(tc.get("sliding_window") or 128) - 1
    n = int(tc["num_hidden_layers"])
    ratios = [int(r) for r in list(tc["compress_ratios"])[:n]]
    sources, indexers = set(tc.get("kv_source_layer_ids") or ()), set(tc.get("index_source_layer_ids") or ())
    terms, latent, index = [], 0.0, 0.0
    for L, r in enumerate(ratios):
        fixed, per_entry, host = window * entry, 0, 0
        if r and L in sources:
            fixed += V4_STATE_BYTES * 2 * r * head
            per_entry, host = entry, entry
            latent += entry / r
            if L in indexers:
                fixed += V4_STATE_BYTES * 2 * index_dim
                per_entry += key
                index += key / r
        terms.append((r if per_entry else 0, per_entry, fixed, host))
    return KVBytes(dtype=dtype, layers=n, latent_bytes=math.ceil(latent / n), indexer_bytes=math.ceil(index / n),
                   cache="compressed", layer_terms=tuple(terms))


KDA_STATE_BYTES = 4  # the recurrent state is float32 (engine/models/kimi_linear/cache.py)
KDA_CONV_BYTES = 2  # the short convolutions' window is kept in the compute dtype (bf16)


def kda_state_bytes(heads: int, head_dim: int, kernel: int) -> int:
    """One KDA layer's per-sequence state, all heads: the [heads, Dk, Dv] recurrent matrix and the last kernel-1
    inputs of the q, k and v convolutions."""
    return KDA_STATE_BYTES * heads * head_dim * head_dim + KDA_CONV_BYTES * (kernel - 1) * 3 * heads * head_dim


def hybrid_kv_bytes(tc: dict, dtype: str) -> KVBytes:
    """Kimi Linear / K3 as the engine keeps it (engine/models/kimi_linear/cache.py): per MLA layer one latent row a token
    (rate 1), per KDA layer a fixed state a sequence (rate 0). The layers' kinds as the family manifest schedules
    them: `linear_attn_config.kda_layers` counts from 1 (kconvert/family/schedule.py checks the lists)."""
    lin = tc["linear_attn_config"]
    kda = {int(L) - 1 for L in lin.get("kda_layers") or ()}
    n = int(tc["num_hidden_layers"])
    row = latent_bytes(int(tc["kv_lora_rank"]), int(tc["qk_rope_head_dim"]), dtype)
    state = kda_state_bytes(int(lin["num_heads"]), int(lin["head_dim"]), int(lin["short_conv_kernel_size"]))
    terms = tuple((0, 0, state, 0) if L in kda else (1, row, 0, row) for L in range(n))
    mla = n - len(kda)
    return KVBytes(dtype=dtype, layers=n, latent_bytes=math.ceil(mla * row / n), indexer_bytes=0, cache="hybrid",
                   layer_terms=terms, split_over_tp=tuple(L in kda for L in range(n)))


TIER_DEVICE_SHARE = 8  # with the host tier the device keeps 1/8 of the latent (newest pages + a page cache)


def kv_options(text_config: dict, free_bytes: int, batch: int, host_bytes: int, tp: int = 1) -> list[dict]:
    """Per KV format: bytes per token, the longest context the device's free bytes hold, and the context
    the host tier reaches: indexer keys of every token + 1/TIER_DEVICE_SHARE of the latent stay on the
    device, the whole latent is in `host_bytes` of host memory (engine.cache.latent with --kv-device-budget). DeepSeek-V4's
    host tier (engine/models/deepseek_v4/cache.py) keeps the CSA entries in host memory, everything else on the device."""
    out = []
    free = max(free_bytes, 0)
    for dtype in KV_DTYPES:
        kv = kv_bytes(text_config, dtype).on_tp(tp)
        lat, idx = kv.layers * kv.latent_bytes, kv.layers * kv.indexer_bytes
        on_device = idx + lat / TIER_DEVICE_SHARE
        tiered = kv.max_context(free, batch, host_bytes) if kv.layer_terms else \
            int(min(free / (batch * on_device), host_bytes / (batch * lat)))
        out.append({"dtype": dtype, "latent_bytes_per_token": lat, "indexer_bytes_per_token": idx,
                    "bytes_per_token": lat + idx, "max_context": kv.max_context(free, batch),
                    "tiered_max_context": tiered, "host_bytes": host_bytes})
    return out
