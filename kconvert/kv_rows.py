"""The KV cache's row codes: how one cached row (an MLA latent, an indexer key, a DeepSeek-V4 K=V entry) is encoded
under each `--kv-dtype`, and the bytes it takes. The one definition the engine's caches (engine/cache/row_format.py,
engine/models/deepseek_v4/entry_format.py) and plan's byte counts (kconvert/plan/kv_bytes.py) share: the caches'
bytes equal the plan's because both read them here (tests/engine/test_kv_cache.py, tests/families/dsv4/test_dsv4_cache.py)."""

from __future__ import annotations

import math

KV_DTYPES = ("bf16", "fp8", "int8", "fp8-ds")
ROW_CODES = ("bf16", "fp8", "int8")  # how one cached row (latent or indexer key) is encoded
LATENT_CODE = {"bf16": "bf16", "fp8": "fp8", "int8": "int8", "fp8-ds": "fp8"}  # the latent's code under each --kv-dtype
INDEX_CODE = {"bf16": "bf16", "fp8": "bf16", "int8": "bf16", "fp8-ds": "fp8"}  # the indexer key's code
SCALE_GROUP = 128  # values per float32 scale in the fp8 / int8 rows


def row_bytes(width: int, code: str) -> int:
    """Bytes of `width` values in a row code: bf16, or 8-bit values + a float32 scale per SCALE_GROUP."""
    if code == "bf16":
        return 2 * width
    return width + 4 * math.ceil(width / SCALE_GROUP)


V4_SCALE_GROUP = 64  # values per scale in DeepSeek-V4's 8-bit K=V rows (one ue8m0 byte each for fp8)


def v4_entry_bytes(head_dim: int, rope: int, code: str) -> int:
    """One DeepSeek-V4 K=V row (a compressed entry or a sliding-window key) in a row code: bf16; fp8 as vLLM and
    SGLang store it (e4m3 no-rope part + bf16 rope part + one ue8m0 byte per 64 values, padded to 8 B: 584 B at
    512 / 64); int8 (int8 no-rope part + bf16 rope + a float32 scale per 64, padded to 8 B: 608 B)."""
    if code == "bf16":
        return 2 * head_dim
    plain = head_dim - rope
    tiles = math.ceil(plain / V4_SCALE_GROUP)
    return -(-(plain + 2 * rope + (tiles if code == "fp8" else 4 * tiles)) // 8) * 8
