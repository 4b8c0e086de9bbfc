"""Engram's compressed token ids: tokens whose single-token text normalises alike share one id, and the n-gram
hashes run over those ids (so " The", "the" and "THE" hash alike).

The normalisation, as DeepSeek-V4.1's reference builds its map (mlx-vlm 0.7.10 `engram.py`, with the `tokenizers`
normalizers): NFKC, NFD, drop combining marks, lower case, runs of space / tab / newline to one space, then strip
(a text that was only whitespace stays one space). A token whose text is not valid UTF-8 on its own keys by its raw
bytes. Ids are handed out in token order, first come first served. A release ships the result as
`engram_token_map.json`; a checkpoint without it gets the map built here from its tokenizer."""

from __future__ import annotations

import re
import unicodedata

from kconvert.family import v41_rules

TOKEN_MAP = v41_rules.TOKEN_MAP

_SPACES = re.compile(r"[ \t\r\n]+")


def normalise(text: str) -> str:
    s = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    s = "".join(ch for ch in s if unicodedata.category(ch) != "Mn").lower()
    s = _SPACES.sub(" ", s)
    return " " if s == " " else s.strip()


def compressed_ids(encoding, vocab: int) -> list[int]:
    """[compressed id of token t for t < vocab] from a tiktoken Encoding (its special tokens included)."""
    keys: dict[object, int] = {}
    out = []
    for t in range(vocab):
        try:
            raw = encoding.decode_single_token_bytes(t)
        except KeyError:  # an id the encoding does not name: its own key
            raw = None
        text = raw.decode("utf-8", errors="replace") if raw is not None else None
        if text is None or "\ufffd" in text:
            key: object = ("raw", raw, t if raw is None else None)
        else:
            key = normalise(text) or text
        out.append(keys.setdefault(key, len(keys)))
    return out


def read_token_map(root, text: dict | None = None, prefix: str = "") -> list[int]:
    """The checkpoint's engram_token_map.json, opened through the containment rule and checked against the text config
    `text` as shard checks a source's (kconvert/family/v41_rules.py: one reader for both)."""
    return v41_rules.read_token_map(root, text or {}, prefix=prefix)
