"""Read a checkpoint's tokenizer (`load_tokenizer`): a Kimi-format one (`tiktoken.model` + `tokenizer_config.json`),
as released by Moonshot (Kimi-K2 / K2.5 / K3) and as our fixtures write it: a byte-level BPE in `tiktoken.model`
(lines `base64(token_bytes) rank`), then 256 special tokens right after the base vocabulary; or a Hugging Face
`tokenizer.json` as DeepSeek releases it (source/hf_tokenizer.py)."""

from __future__ import annotations

import base64
import binascii
from pathlib import Path

import tiktoken

from kconvert.errors import TokenizerError
from kconvert.io.paths import side_file
from kconvert.io.side_files import MAX_CONFIG, MAX_TEXT, read_json, read_text

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


def _read_text(path: Path) -> str:
    return read_text(path, limit=MAX_TEXT, error=TokenizerError)  # Kimi's tiktoken.model is 2.7 MB


def _read_ranks(path: Path) -> dict[bytes, int]:
    """`base64(token) rank` per line; ranks must be 0..n-1, each once (tiktoken aborts the process otherwise)."""
    ranks: dict[bytes, int] = {}
    for no, line in enumerate(_read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            tok, rank = line.split()
            key, value = base64.b64decode(tok, validate=True), int(rank)
        except (ValueError, binascii.Error):
            raise TokenizerError(f"line {no} is not `base64(token) rank`", file=str(path)) from None
        if key in ranks:
            raise TokenizerError(f"line {no}: token listed twice", file=str(path))
        ranks[key] = value
    if not ranks:
        raise TokenizerError("no tokens", file=str(path))
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerError(f"ranks are not 0..{len(ranks) - 1}, each once", file=str(path))
    return ranks


def _special_names(cfg_path: Path) -> dict[int, str]:
    """id -> name from tokenizer_config.json's `added_tokens_decoder` (empty without the file)."""
    if not cfg_path.exists():
        return {}
    cfg = read_json(cfg_path, limit=MAX_CONFIG, error=TokenizerError)
    if not isinstance(cfg, dict):
        raise TokenizerError("must be a JSON object", file=str(cfg_path))
    decoder = cfg.get("added_tokens_decoder", {})
    if not isinstance(decoder, dict):
        raise TokenizerError("added_tokens_decoder must be an object (id -> token)", file=str(cfg_path))
    names = {}
    for key, value in decoder.items():
        content = value.get("content") if isinstance(value, dict) else None
        if not key.isdigit() or not isinstance(content, str):
            raise TokenizerError(f"added_tokens_decoder[{key!r}] needs a numeric id and a string `content`",
                                 file=str(cfg_path))
        names[int(key)] = content
    return names


def load_kimi_tokenizer(model_dir: str | Path) -> tiktoken.Encoding:
    """Read a Kimi-format tokenizer (this fixture's or a real release's) into a tiktoken Encoding.

    Special tokens: the 256 ids after the base vocabulary, named from `added_tokens_decoder`
    (`<|reserved_token_ID|>` where unnamed), as Kimi's tokenization_kimi.py does."""
    d = Path(model_dir)
    ranks = _read_ranks(side_file(d, "tiktoken.model") or d / "tiktoken.model")
    base = len(ranks)
    names = _special_names(side_file(d, "tokenizer_config.json") or d / "tokenizer_config.json")
    specials = {names.get(i, f"<|reserved_token_{i}|>"): i for i in range(base, base + NUM_SPECIAL)}
    if len(specials) != NUM_SPECIAL:
        raise TokenizerError("added_tokens_decoder gives two special tokens the same name",
                             file=str(d / "tokenizer_config.json"))
    return tiktoken.Encoding(name=d.name or "kimi", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks, special_tokens=specials)


def load_tokenizer(model_dir: str | Path):
    """The checkpoint's tokenizer, whichever format it ships: Kimi's `tiktoken.model` (a tiktoken Encoding) or a
    Hugging Face `tokenizer.json` (DeepSeek's releases: source/hf_tokenizer.HFEncoding, the same calls)."""
    d = Path(model_dir)
    if (d / "tiktoken.model").exists():
        return load_kimi_tokenizer(d)
    if (d / "tokenizer.json").exists():
        from kconvert.source.hf_tokenizer import HFEncoding

        return HFEncoding(side_file(d, "tokenizer.json") or d / "tokenizer.json")
    raise TokenizerError("no tokenizer beside the checkpoint (tiktoken.model or tokenizer.json)", file=str(d))
