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
from pathlib import Path

from kconvert.errors import CheckpointError
from kconvert.io.side_files import MAX_TEXT, read_json

TOKEN_MAP = "engram_token_map.json"

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


def read_token_map(root) -> list[int]:
    """The checkpoint's engram_token_map.json: one compressed id (a non-negative integer) per token."""
    path = Path(root) / TOKEN_MAP
    if not path.is_file():
        raise CheckpointError(f"{TOKEN_MAP} is absent: the Engram layers cannot hash their n-grams without it (the "
                              "release ships it beside config.json; shard copies it)", file=str(path))
    ids = read_json(path, limit=MAX_TEXT)
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(ids)
                                                       for i in ids):
        raise CheckpointError("must be a JSON list of compressed ids, each in [0, its length)", file=str(path))
    return ids
