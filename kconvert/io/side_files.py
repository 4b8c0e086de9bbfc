"""The one reader of JSON and text side files (config.json, the index, kconvert.json, tokenizer files,
prompts, journals): bounded, and regular files only.

Why each guard: files are opened by io/regular.py (regular files only, never blocking: a FIFO would block
forever, a character device would never end); a huge file costs many times its size once parsed, so
every read has a byte limit chosen by the caller (`MAX_*` below); JSON nested thousands deep ends
Python's decoder in RecursionError, and nesting deeper than any real config breaks recursive code
later, so decoding stops at `MAX_DEPTH` levels. Every refusal is the caller's KConvertError class,
one line naming the file; a missing file is MissingFileError (also a FileNotFoundError)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

from kconvert.errors import CheckpointError, KConvertError
from kconvert.io.pread import MAP_POPULATED_AT_LEAST, map_populated
from kconvert.io.regular import open_regular

MiB = 1 << 20
MAX_CONFIG = 16 * MiB      # config.json, tokenizer_config.json, pack state: real ones are a few KB
MAX_INDEX = 256 * MiB      # model.safetensors.index.json: ~10 MB for a 1T-parameter INT4 release
MAX_CATALOG = 256 * MiB    # kconvert.json: every tensor of every rank
MAX_TEXT = 256 * MiB       # tiktoken.model (Kimi's is 2.7 MB), chat templates, prompt files, journals
MAX_DEPTH = 64             # JSON nesting: real configs nest under 10 levels


def check_regular(path: str | os.PathLike, *, error: type[KConvertError] = CheckpointError) -> None:
    """Refuse `path` unless it is a regular file, without blocking: for files another library opens
    (a reference .safetensors), where a FIFO would hang it."""
    fd, _ = open_regular(Path(path), error)
    os.close(fd)


def read_bytes(path: str | os.PathLike, *, limit: int, error: type[KConvertError] = CheckpointError) -> bytes:
    """The whole of a regular file of at most `limit` bytes."""
    return _whole(Path(path), limit, error, mapped=False)


def mapped_bytes(path: str | os.PathLike, *, limit: int, error: type[KConvertError] = CheckpointError):
    """`read_bytes`' file, the same guards, as a read-only mapping when it is large (io/pread.map_populated: a 10 MB
    index mapped from the page cache rather than faulted into a fresh buffer page by page and copied), else as bytes.
    Either has find(), slices and the buffer protocol; bytes(...) copies a mapping."""
    return _whole(Path(path), limit, error, mapped=True)


def _whole(path: Path, limit: int, error: type[KConvertError], mapped: bool):
    fd, size = open_regular(path, error)
    try:
        if size > limit:
            raise error(f"{size} bytes: over the {_human(limit)} limit for this file", file=str(path))
        if mapped and size >= MAP_POPULATED_AT_LEAST:
            return map_populated(fd, size)
        chunks, got = [], 0
        while got <= size:  # one byte past the size seen: a file that grows while read is refused, not followed
            b = os.read(fd, size + 1 - got)  # all at once: one buffer, and join returns a lone chunk uncopied
            if not b:
                break
            chunks.append(b)
            got += len(b)
        if got > size:
            raise error("changed size while being read", file=str(path))
        return b"".join(chunks)
    except OSError as e:
        raise error(f"cannot be read ({e.strerror or e})", file=str(path)) from None
    finally:
        os.close(fd)


def read_text(path: str | os.PathLike, *, limit: int = MAX_TEXT,
              error: type[KConvertError] = CheckpointError) -> str:
    raw = read_bytes(path, limit=limit, error=error)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise error("not UTF-8 text", file=str(path)) from None


def read_json(path: str | os.PathLike, *, limit: int = MAX_CONFIG, error: type[KConvertError] = CheckpointError,
              parse_constant: Callable[[str], object] | None = None) -> object:
    """The decoded JSON of a bounded regular file (any JSON value: callers check its type)."""
    return parse_json(read_bytes(path, limit=limit, error=error), file=str(path), error=error,
                      parse_constant=parse_constant)


def parse_json(raw: bytes | str, *, file: str, error: type[KConvertError] = CheckpointError,
               parse_constant: Callable[[str], object] | None = None, tensor: str | None = None) -> object:
    """json.loads with one-line errors and at most MAX_DEPTH levels of nesting (also for JSON that is not
    a file of its own: a safetensors header, a reference's metadata)."""
    try:
        obj = json.loads(raw, parse_constant=parse_constant)
    except RecursionError:
        raise error(f"JSON nested deeper than {MAX_DEPTH} levels", file=file, tensor=tensor) from None
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError, a number past Python's digit limit
        raise error(f"not valid JSON ({_short(e)})", file=file, tensor=tensor) from None
    if openings_over(raw, MAX_DEPTH) and _depth_over(obj, MAX_DEPTH):
        raise error(f"JSON nested deeper than {MAX_DEPTH} levels", file=file, tensor=tensor)
    return obj


def openings_over(raw: bytes | str, limit: int) -> bool:
    """Whether `raw` holds more than `limit` '{' and '[' (counted in any encoding, and in strings too): with
    fewer, nesting cannot go deeper, and a 200k-tensor index (3 objects) needs no walk. Each find is a memchr;
    counting stops at limit + 1."""
    left = limit
    for c in ("{", "[") if isinstance(raw, str) else (b"{", b"["):
        i = raw.find(c)
        while i >= 0:
            left -= 1
            if left < 0:
                return True
            i = raw.find(c, i + 1)
    return False


def _depth_over(obj: object, limit: int) -> bool:
    """Whether containers nest more than `limit` deep (iterative: deep input must not recurse here)."""
    stack = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if d > limit:
            return True
        kids = o.values() if isinstance(o, dict) else o if isinstance(o, list) else ()
        stack.extend((k, d + 1) for k in kids if isinstance(k, (dict, list)))
    return False


def _short(e: Exception) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= 120 else text[:117] + "..."


def _human(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n} bytes"
