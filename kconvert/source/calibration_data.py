"""Calibration tokens for `--calibrate DATA`: windows of `seq` tokens drawn, seeded, from a text file, a
directory of text files or JSONL (`{"text": ...}` or `{"messages": [{"role", "content"}, ...]}`, chat turns
in Kimi's markers), tokenized by the checkpoint's own tokenizer. `stdlib` is the bundled set, for tests and
benchmarks: Python standard-library sources that neither the trained fixtures' corpus
(kconvert/fixtures/training/text.py) nor verify's held-out prompts (kconvert/verify/prompts.py) use.

The record (what kconvert.json keeps) names the data by a digest of its text, so a conversion says what
calibrated it and a re-run with other data is not taken for a resume."""

from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path
from typing import TYPE_CHECKING

from kconvert.errors import UsageError
from kconvert.io.side_files import MAX_TEXT, parse_json, read_bytes

if TYPE_CHECKING:
    import torch

BUNDLED = "stdlib"
BUNDLED_FILES = ("argparse.py", "dataclasses.py", "enum.py", "functools.py")
TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".json", ".jsonl")
DEFAULT_TOKENS, DEFAULT_SEQ, DEFAULT_SEED = 64 * 256, 256, 0
# Bounds of the options (one line past them, never an allocation failure): 2^24 tokens is 64x the 256k GPTQ
# usually calibrates on and 1024x the default (every token's activations are held per layer); 2^20 a window.
MAX_TOKENS, MAX_SEQ = 1 << 24, 1 << 20
MAX_DIR_DEPTH = 64  # directories below DATA: a tree nested deeper is refused (a walk must not recurse 1500 deep)
# All of DATA together, in bytes of text (each file is also at most side_files.MAX_TEXT): 16x the text of
# MAX_TOKENS at ~4 bytes a token; a larger corpus is a subset's job, not a 10 GB tokenizer buffer's.
MAX_DATA = 256 * 1024 * 1024
# The tokenizer is handed at most this many characters at a time, cut before a space that follows a word (a
# boundary of the tokenizer's own pre-split, so ordinary text encodes to the same ids as whole): one long run
# without whitespace (300 MB of it made the tokenizer ask for 10-64 GB and abort) is cut there too.
ENCODE_CHUNK = 1 << 20


def check_data_name(data: str) -> None:
    """DATA names something: '' (or blanks) would be the current directory, read recursively."""
    if not data.strip():
        raise UsageError(f"--calibrate needs DATA: a text file, a directory of text files, JSONL or '{BUNDLED}' "
                         f"(got {data!r})")


def check_out_outside(data: str, out: str) -> None:
    """OUT must not lie inside a DATA directory: a rerun would read OUT's own JSON (kconvert.json, rank lists,
    an export's config) as calibration text, calibrate on other data and find OUT "a different conversion"."""
    if data == BUNDLED or not Path(data).is_dir():
        return
    root, target = Path(data).resolve(), Path(out).resolve()
    if target == root or root in target.parents:
        raise UsageError(f"OUT lies inside the --calibrate directory {data}: a rerun would read its files as "
                         "calibration data; choose an OUT outside it", file=str(out))


def read_documents(data: str) -> list[str]:
    """The documents of DATA (the bundled set's name, a file, or a directory of files, sorted by name)."""
    check_data_name(data)
    if data == BUNDLED:
        root = Path(sysconfig.get_paths()["stdlib"])
        return [_read(root / n) for n in BUNDLED_FILES]
    path = Path(data)
    if path.is_dir():
        files = sorted(_text_files(path))
        if not files:
            raise UsageError(f"no text files ({', '.join(TEXT_SUFFIXES)}) in the calibration directory", file=data)
        docs, total = [], 0
        for f in files:
            docs += _documents(f)
            total += f.stat().st_size
            if total > MAX_DATA:
                raise UsageError(f"calibration data over {MAX_DATA >> 20} MiB of text: pass a subset (the run draws "
                                 f"at most {MAX_TOKENS} tokens)", file=data)
        return docs
    if not path.is_file():
        raise UsageError("calibration data not found (a text file, a directory or JSONL)", file=data)
    return _documents(path)


def encode_chunked(text: str, encode, chunk: int = ENCODE_CHUNK) -> list[int]:
    """`encode(text)` a piece of at most `chunk` characters at a time (ENCODE_CHUNK's note says where pieces end)."""
    ids: list[int] = []
    start = 0
    while start < len(text):
        end = min(start + chunk, len(text))
        if end < len(text):
            cut = text.rfind(" ", start + chunk // 2, end)
            while cut > start and text[cut - 1].isspace():  # before a run of blanks, not inside it
                cut = text.rfind(" ", start + chunk // 2, cut - 1) if cut - 1 > start + chunk // 2 else -1
            end = cut if cut > start else end  # no word boundary in the second half: a hard cut
        ids += encode(text[start:end])
        start = end
    return ids


def _text_files(root: Path) -> list[Path]:
    """The files under `root` with a text suffix: an iterative walk, at most MAX_DIR_DEPTH directories deep,
    not into symlinked directories (as Path.rglob), refused past the depth rather than recursing."""
    found, stack = [], [(root, 0)]
    while stack:
        folder, depth = stack.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError as e:
            raise UsageError(f"cannot list the calibration directory ({e.strerror or e})", file=str(folder)) from None
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                if depth + 1 > MAX_DIR_DEPTH:
                    raise UsageError(f"the calibration directory nests deeper than {MAX_DIR_DEPTH} levels",
                                     file=str(root))
                stack.append((Path(entry.path), depth + 1))
            elif entry.name.endswith(TEXT_SUFFIXES) and entry.is_file():
                found.append(Path(entry.path))
    return found


def _read(path: Path) -> str:
    raw = read_bytes(path, limit=MAX_TEXT, error=UsageError)  # regular files only: a FIFO never blocks
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError("calibration file is not UTF-8 text", file=str(path)) from None


def _documents(path: Path) -> list[str]:
    text = _read(path)
    if path.suffix != ".jsonl":
        return [text]
    docs = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:  # nesting bounded, numbers within Python's digit limit: one line, never RecursionError
            row = parse_json(line, file=str(path), error=UsageError)
        except UsageError as e:
            raise UsageError(f"line {i} is {e.message}", file=str(path)) from None
        doc = _render(row, path, i)
        try:
            doc.encode("utf-8")
        except UnicodeEncodeError as e:  # a \ud800 escape decodes to a lone surrogate: no text to tokenize
            raise UsageError(f"line {i} holds a lone surrogate ({doc[e.start]!r}): not text", file=str(path)) from None
        docs.append(doc)
    return docs


def _render(row, path: Path, line: int) -> str:
    if isinstance(row, dict) and isinstance(row.get("text"), str):
        return row["text"]
    turns = row.get("messages", row.get("chat")) if isinstance(row, dict) else None
    if isinstance(turns, list) and turns and all(isinstance(t, dict) and isinstance(t.get("role"), str)
                                                 and isinstance(t.get("content"), str) for t in turns):
        return "".join(f"<|im_{t['role']}|>{t['role']}<|im_middle|>{t['content']}<|im_end|>" for t in turns)
    raise UsageError(f'line {line} needs {{"text": "..."}} or {{"messages": [{{"role", "content"}}, ...]}}',
                     file=str(path))


def calibration_windows(data: str, encode, tokens: int = DEFAULT_TOKENS, seq: int = DEFAULT_SEQ,
                        seed: int = DEFAULT_SEED) -> tuple[torch.Tensor, dict]:
    """(ids [n, seq] int64 with n = ceil(tokens / seq), record) from DATA, encoded by `encode(text) -> ids`.
    The documents are joined by blank lines; window starts are drawn by a generator seeded with `seed`."""
    if not (1 <= tokens <= MAX_TOKENS and 2 <= seq <= MAX_SEQ):
        raise UsageError(f"--calibration-tokens must be in [1, {MAX_TOKENS}] and --calibration-seq in [2, {MAX_SEQ}] "
                         f"(got {tokens}, {seq})")
    docs = read_documents(data)
    text = "\n\n".join(docs)
    import torch  # here, not at import: the CLI reads this module's defaults for its --help

    ids = torch.tensor(encode_chunked(text, encode), dtype=torch.int64)
    if ids.numel() < seq:
        raise UsageError(f"calibration data holds {ids.numel()} tokens, fewer than one window of {seq}", file=data)
    n = -(-tokens // seq)
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - seq + 1, (n,), generator=g)
    windows = torch.stack([ids[s:s + seq] for s in starts.tolist()])
    record = {"data": data if data == BUNDLED else str(Path(data).resolve()),
              "sha256": hashlib.sha256(text.encode()).hexdigest()[:16],
              "tokens": n * seq, "seq": seq, "seed": seed, "documents": len(docs)}
    return windows, record
