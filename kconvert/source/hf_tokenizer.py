"""Read a Hugging Face `tokenizer.json` (DeepSeek's releases: V3, V3.2, V4, V4.1) with the `tokenizers` library,
behind the calls kconvert makes of a tiktoken Encoding (kconvert/source/tokenizer.py: `load_tokenizer` picks the
format): `encode`, `decode_bytes`, `decode_single_token_bytes`, `_special_tokens` (name -> id), `n_vocab`.

The file is data, never code: `Tokenizer.from_str` builds the tokenizer from the JSON alone (no remote code, no
`tokenizer_class` import). Byte-level BPE tokens (DeepSeek's `ByteLevel` decoder) turn back into their bytes through
GPT-2's byte alphabet, one token at a time, so chat can stream a character split over two tokens; SentencePiece-style
vocabularies (`▁` for a space, `<0xAB>` byte fallbacks) likewise."""

from __future__ import annotations

from pathlib import Path

from kconvert.errors import TokenizerError
from kconvert.io.side_files import MAX_TEXT, parse_json, read_text


def byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable Latin-1 bytes stand for themselves, the other 68
    bytes for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {chr(b): b for b in printable}, 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def _is_byte_level(decoder) -> bool:
    if not isinstance(decoder, dict):
        return False
    if decoder.get("type") == "ByteLevel":
        return True
    return decoder.get("type") == "Sequence" and any(map(_is_byte_level, decoder.get("decoders") or []))


class HFEncoding:
    """A tokenizer.json, read once (bounded, regular file), with tiktoken's Encoding calls."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer

        text = read_text(path, limit=MAX_TEXT, error=TokenizerError)
        doc = parse_json(text, file=str(path), error=TokenizerError)
        if not isinstance(doc, dict) or not isinstance(doc.get("model"), dict):
            raise TokenizerError("not a tokenizer.json (no `model` object)", file=str(path))
        try:
            self.tok = Tokenizer.from_str(text)
        except Exception as e:  # the library's own message, first line: which field it could not read
            raise TokenizerError(f"the tokenizers library cannot read it: {str(e).splitlines()[0][:200]}",
                                 file=str(path)) from None
        self.name = Path(path).parent.name or "tokenizer"
        self._special_tokens = {t.content: i for i, t in self.tok.get_added_tokens_decoder().items() if t.special}
        self.n_vocab = self.tok.get_vocab_size(with_added_tokens=True)
        self._bytes_of = byte_alphabet() if _is_byte_level(doc.get("decoder")) else None
        self._specials = set(self._special_tokens.values())

    def encode(self, text: str, allowed_special="all") -> list[int]:
        """Token ids of `text`; special tokens written in it are those tokens (as tiktoken's allowed_special="all");
        nothing added around it (a BOS comes from the chat template, as the release's own code does)."""
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode_single_token_bytes(self, token: int) -> bytes:
        piece = self.tok.id_to_token(int(token))
        if piece is None:
            raise KeyError(token)
        if token in self._specials:
            return piece.encode()
        if self._bytes_of is not None:
            try:
                return bytes(self._bytes_of[c] for c in piece)
            except KeyError:  # an added (non-special) token written as plain text
                return piece.encode()
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # SentencePiece byte fallback
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode()

    def decode_bytes(self, ids) -> bytes:
        return b"".join(map(self.decode_single_token_bytes, ids))
