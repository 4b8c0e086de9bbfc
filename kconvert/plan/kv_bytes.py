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
Models without the indexer (DeepSeek-V3, Kimi-K2: no `index_topk`) have no indexer cache.

Under DeepSeek's tensor-parallel layout the latent is not split by heads (it has none): every rank
holds the whole latent and indexer cache of every sequence it serves, so these are bytes per token
*per rank*, whatever the tp degree.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from kconvert.errors import UsageError

KV_DTYPES = ("bf16", "fp8", "int8", "fp8-ds")
ROW_CODES = ("bf16", "fp8", "int8")  # how one cached row (latent or indexer key) is encoded
LATENT_CODE = {"bf16": "bf16", "fp8": "fp8", "int8": "int8", "fp8-ds": "fp8"}  # the latent's code under each --kv-dtype
INDEX_CODE = {"bf16": "bf16", "fp8": "bf16", "int8": "bf16", "fp8-ds": "fp8"}  # the indexer key's code
SCALE_GROUP = 128  # values per float32 scale in the fp8 / int8 rows


@dataclass(frozen=True)
class KVBytes:
    dtype: str
    layers: int
    latent_bytes: int  # per token per layer
    indexer_bytes: int  # per token per layer
    cache: str = "mla"  # mla: one latent per token; compressed (V4): entries per rate, averaged over layers

    @property
    def per_layer(self) -> int:
        return self.latent_bytes + self.indexer_bytes

    @property
    def per_token(self) -> int:
        """Bytes per token per rank, all layers."""
        return self.layers * self.per_layer

    def to_json(self) -> dict:
        return {**asdict(self), "bytes_per_token_per_layer": self.per_layer, "bytes_per_token": self.per_token,
                "replicated_across_tp": True}


def row_bytes(width: int, code: str) -> int:
    """Bytes of `width` values in a row code: bf16, or 8-bit values + a float32 scale per SCALE_GROUP."""
    if code == "bf16":
        return 2 * width
    return width + 4 * math.ceil(width / SCALE_GROUP)


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
    if "kv_lora_rank" not in tc and ("compress_ratios" in tc or "layer_types" in tc):
        return compressed_kv_bytes(tc, dtype)
    index_dim = int(tc.get("index_head_dim") or 0) if tc.get("index_topk") else 0
    return KVBytes(
        dtype=dtype,
        layers=int(tc["num_hidden_layers"]),
        latent_bytes=latent_bytes(int(tc["kv_lora_rank"]), int(tc["qk_rope_head_dim"]), dtype),
        indexer_bytes=indexer_bytes(index_dim, dtype),
    )


def compressed_rates(tc: dict) -> list[int]:
    """DeepSeek-V4: each decoder layer's compression rate (0 = sliding window only), from either spelling
    (the family binding has checked them already)."""
    n = int(tc["num_hidden_layers"])
    if tc.get("compress_ratios") is not None:
        return [int(r) for r in tc["compress_ratios"][:n]]
    rates = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128,
             **(tc.get("compress_rates") or {})}
    return [int(rates[t]) for t in tc["layer_types"][:n]]


def compressed_kv_bytes(tc: dict, dtype: str) -> KVBytes:
    """DeepSeek-V4's cache per token, averaged over the decoder layers (rounded up): a layer of rate m keeps
    one shared K=V entry per m tokens (head_dim values: bf16, or vLLM's fp8_ds_mla 584 B = e4m3 no-rope part +
    bf16 rope + one ue8m0 scale per 64, padded to 8 B), a CSA layer (the indexer's rate) also an indexer key per
    m tokens. Sliding-only layers and every layer's last `sliding_window` tokens are a fixed amount per
    sequence, not per token, and are not counted here."""
    head, rope = int(tc["head_dim"]), int(tc.get("qk_rope_head_dim") or 0)
    if LATENT_CODE[dtype] == "bf16":
        entry = 2 * head
    else:
        entry = -(-((head - rope) + 2 * rope + math.ceil((head - rope) / 64)) // 8) * 8
    csa = int((tc.get("compress_rates") or {}).get("compressed_sparse_attention", 4))
    rates = [r for r in compressed_rates(tc) if r]
    n = int(tc["num_hidden_layers"])
    latent = sum(entry / r for r in rates)
    index = sum(indexer_bytes(int(tc.get("index_head_dim") or 0), dtype) / r for r in rates if r == csa)
    return KVBytes(dtype=dtype, layers=n, latent_bytes=math.ceil(latent / n), indexer_bytes=math.ceil(index / n),
                   cache="compressed")


TIER_DEVICE_SHARE = 8  # with the host tier the device keeps 1/8 of the latent (newest pages + a page cache)


def kv_options(text_config: dict, free_bytes: int, batch: int, host_bytes: int) -> list[dict]:
    """Per KV format: bytes per token, the longest context the device's free bytes hold, and the context
    the host tier reaches: indexer keys of every token + 1/TIER_DEVICE_SHARE of the latent stay on the
    device, the whole latent is in `host_bytes` of host memory (engine.cache with --kv-device-budget)."""
    out = []
    free = max(free_bytes, 0)
    for dtype in KV_DTYPES:
        kv = kv_bytes(text_config, dtype)
        lat, idx = kv.layers * kv.latent_bytes, kv.layers * kv.indexer_bytes
        on_device = idx + lat / TIER_DEVICE_SHARE
        out.append({"dtype": dtype, "latent_bytes_per_token": lat, "indexer_bytes_per_token": idx,
                    "bytes_per_token": lat + idx, "max_context": free // (batch * (lat + idx)),
                    "tiered_max_context": int(min(free / (batch * on_device), host_bytes / (batch * lat))),
                    "host_bytes": host_bytes})
    return out
