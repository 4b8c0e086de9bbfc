"""What keeps a calibrated run's peak memory near one layer's (engine/calibrate/layerwise.py uses these).

Measured on tiny-k25-dsv32-trained (64 x 256 calibration tokens, hidden 256: 16 MiB of activations per copy): the
calibrated shard peaked at 643 MiB, 2.6x an uncalibrated one (244 MiB); with these and calibrate.py's
in-place buffers, 386 MiB (1.48x the uncalibrated shard plus the activations), the same codes byte for byte.
- calibrate.py: the next layer's input overwrites this one's in place, micro-batch by micro-batch; the MoE's
  input over all tokens fills one buffer (TokenRows; a list of pieces plus its concatenation was 2 copies);
  one KV cache per pass, reset between micro-batches (a cache is a reference cycle: a new one each
  micro-batch left them all to the garbage collector); an expert's SwiGLU in place (an expert can take
  every token: xe, gate and up outputs held at once, not five such tensors); the source's float32 weights
  dropped as each is replaced by its dequantized copy.
- glibc's heap: freed float32 temporaries (up to 32 MiB each here) stay in the heap, because glibc raises its
  mmap threshold to the largest block freed so far. A fixed threshold puts every block of MMAP_THRESHOLD or
  more in its own mapping, returned to the system when torch frees it; malloc_trim gives back the rest
  between layers. Set inside the process (a user sets no environment variable), glibc only.
- the engine's prefill chunks: the DSA indexer scores [queries, heads, keys] and the attention gathers latent
  rows, each in blocks of up to 2^25 / 2^26 elements (sized for a GPU); calibration's micro-batches of 8
  sequences made those blocks 32 MiB each plus copies. Smaller blocks split the same work along the
  queries only: every output is the same dot product, bit for bit (tests/convert/test_calibrate.py checks it)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools

import torch

MMAP_THRESHOLD = 256 << 10  # bytes: larger blocks get their own mapping (glibc's static default is 128 KiB)
M_MMAP_THRESHOLD = -3  # mallopt parameter number (malloc.h)
SCORE_BUDGET = 1 << 21  # elements of one indexer score block during calibration (8 MiB float32)
GATHER_BUDGET = 1 << 21  # elements of gathered latent rows held at once during calibration


@functools.cache
def _libc():
    """glibc, or None (another C library: nothing to tune)."""
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return lib if hasattr(lib, "malloc_trim") and hasattr(lib, "mallopt") else None
    except OSError:
        return None


@functools.cache
def fixed_mmap_threshold() -> bool:
    """Once per process: blocks of MMAP_THRESHOLD or more are mapped on their own (and unmapped when freed).
    Never undone: the rest of the process (the remainder of `shard`, a test session) keeps the threshold."""
    lib = _libc()
    return bool(lib and lib.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))


def trim() -> None:
    """Give the heap's free pages back to the system (between layers and phases)."""
    lib = _libc()
    if lib:
        lib.malloc_trim(0)


@contextlib.contextmanager
def small_prefill_blocks(score: int = SCORE_BUDGET, gather: int = GATHER_BUDGET):
    """The engine's prefill score / gather blocks at calibration's budgets (elements) for the duration."""
    from engine.models.deepseek_v3 import dsa_indexer as indexer, mla as attention

    saved = indexer.SCORE_BUDGET, attention.GATHER_BUDGET
    indexer.SCORE_BUDGET, attention.GATHER_BUDGET = score, gather
    try:
        yield
    finally:
        indexer.SCORE_BUDGET, attention.GATHER_BUDGET = saved


class TokenRows:
    """The MoE's inputs over every calibration token, [tokens, hidden], filled micro-batch by micro-batch
    (one buffer: no list of pieces and no concatenated copy beside it), and the tokens' ids where the MoE
    was given them (DeepSeek-V4's hash routing reads them)."""

    def __init__(self, tokens: int):
        self.rows: torch.Tensor | None = None
        self.ids: torch.Tensor | None = None
        self.tokens, self.filled, self.all_ids = tokens, 0, True

    def add(self, x: torch.Tensor, ids: torch.Tensor | None = None) -> None:
        x = x.reshape(-1, x.shape[-1])
        if self.rows is None:
            self.rows = torch.empty(self.tokens, x.shape[1], dtype=x.dtype)
            self.ids = torch.empty(self.tokens, dtype=torch.long)
        self.rows[self.filled:self.filled + len(x)] = x
        if ids is None:
            self.all_ids = False
        else:
            self.ids[self.filled:self.filled + len(x)] = ids.reshape(-1)
        self.filled += len(x)

    def token_ids(self) -> torch.Tensor | None:
        """Every row's token id, or None when some call came without them."""
        return self.ids if self.all_ids else None


def rel_error(out: torch.Tensor, ref: torch.Tensor, step: int) -> float:
    """||out - ref|| / ||ref||, `step` rows at a time (no whole-size difference tensor)."""
    num = den = 0.0
    for i in range(0, len(ref), step):
        num += float((out[i:i + step] - ref[i:i + step]).double().square().sum())
        den += float(ref[i:i + step].double().square().sum())
    return (num / max(den, 1e-60)) ** 0.5
