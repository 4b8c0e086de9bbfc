"""Turn a stream of token bytes into printable text without ever printing part of a character.

A token is a run of bytes, not of characters: a 3-byte CJK character or a 4-byte emoji is often split
across two to four tokens. Bytes are held until they complete a UTF-8 sequence; a sequence that can never
complete (an invalid byte) prints as U+FFFD, as any UTF-8 decoder would; an incomplete tail left when the
answer ends is dropped, not shown as a broken character."""

from __future__ import annotations

import codecs


class TextStream:
    def __init__(self):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, data: bytes) -> str:
        """The text that `data` completes (possibly empty)."""
        return self._decoder.decode(data)

    def close(self) -> str:
        """End of the answer: forget an incomplete tail; the stream can be used again."""
        held, _ = self._decoder.getstate()
        self._decoder.reset()
        return "" if held else self._decoder.decode(b"", final=True)
