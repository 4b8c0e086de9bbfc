"""Read a Kimi-format tokenizer (`tiktoken.model` + `tokenizer_config.json`), as released by Moonshot
(Kimi-K2 / K2.5) and as our fixtures write it: a byte-level BPE in `tiktoken.model` (lines
`base64(token_bytes) rank`), then 256 special tokens right after the base vocabulary."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import tiktoken

NUM_SPECIAL = 256

# Kimi's pre-tokenizer pattern (tokenization_kimi.py); tiktoken's regex engine accepts `&&`.
KIMI_PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)


def _read_ranks(path: Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for line in path.read_text(encoding="ascii").splitlines():
        if not line.strip():
            continue
        tok, rank = line.split()
        ranks[base64.b64decode(tok)] = int(rank)
    return ranks


def load_kimi_tokenizer(model_dir: str | Path) -> tiktoken.Encoding:
    """Read a Kimi-format tokenizer (this fixture's or a real release's) into a tiktoken Encoding.

    Special tokens: the 256 ids after the base vocabulary, named from `added_tokens_decoder`
    (`<|reserved_token_ID|>` where unnamed), as Kimi's tokenization_kimi.py does."""
    d = Path(model_dir)
    ranks = _read_ranks(d / "tiktoken.model")
    base = len(ranks)
    cfg_path = d / "tokenizer_config.json"
    decoder = json.loads(cfg_path.read_text(encoding="utf-8")).get("added_tokens_decoder", {}) if cfg_path.exists() else {}
    names = {int(k): v["content"] for k, v in decoder.items()}
    specials = {names.get(i, f"<|reserved_token_{i}|>"): i for i in range(base, base + NUM_SPECIAL)}
    return tiktoken.Encoding(name=d.name or "kimi", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks, special_tokens=specials)
