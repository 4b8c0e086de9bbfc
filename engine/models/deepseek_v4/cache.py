"""DeepSeek-V4's decode cache, sized for a 1M-token context (docs/KV_CACHE.md, "DeepSeek-V4").

Per layer it holds what the next token needs and nothing it can recompute: a ring of the sliding branch's
last `window - 1` K=V rows, and per compressor (the attention's and, on CSA layers, the indexer's) its
compressed entries in pages (engine/cache/paged_rows.py) plus a fixed-size float32 running state: the projected
rows of the window still filling up and, for CSA, the last full window's first series (windows overlap).
Rows are stored in the --kv-dtype's code (engine/models/deepseek_v4/entry_format.py); nothing the cache keeps is a view of a
forward call's tensors, so a long prefill leaves only these behind. Bytes: kconvert.plan.kv_bytes'
`compressed_kv_bytes`, exactly (`bytes_in_use`). The host tier (V4Cache) keeps CSA entries in host memory.

Every sequence of a batch moves in lock-step (same length). Going back (speculative decoding drops the tokens
its target rejected) works from a mark: `V4Cache.mark()` copies each layer's fixed-size state (the ring, the
compressors' pending rows and overlap, their entry counts) and from then on keeps the rows each step adds
(K=V rows, the compressors' projected rows, each completed window's overlap); `rollback(n)` rebuilds the state
at any length n since the mark from them, exactly as the tokens up to n alone would have left it. Without a
mark the cache is kept at its length or reset to 0."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.cache.latent import KVOptions, Step
from engine.cache.row_format import check_kv_dtype, row_codes
from engine.models.deepseek_v4.entry_format import EntryFormat, key_format
from engine.cache.paged_rows import Ring
from engine.models.deepseek_v4.compressor_state import CompressorState
from kconvert.errors import EngineError, UsageError


@dataclass
class LayerRows:
    """A V4 / V4.1 layer's cache beside its compressed states (`stores()`: entries first, the host tier's): row codes,
    the sliding ring, length and mark. Made alone (a layer called directly, as tests do) it stores the compute dtype."""
    entry_code: str | None = None
    index_code: str | None = None
    host_entries: bool = False  # the host tier: compressed entries in host memory, a step fetches what it attends to
    length: int = 0  # tokens seen
    ring: Ring | None = None  # the sliding branch's last window - 1 K=V rows
    ring_fmt: EntryFormat | None = None
    marked: int | None = None  # the length at mark()

    family = "DeepSeek-V4"  # in messages

    def stores(self) -> tuple[CompressorState, CompressorState]:
        raise NotImplementedError
    def at(self, start: int) -> "LayerRows":
        """This layer's state for tokens from `start`: a new sequence (start 0) clears it."""
        if start == 0 and self.length:
            self.__init__(self.entry_code, self.index_code, self.host_entries)
        if start != self.length:
            raise EngineError(f"{self.family} cache holds {self.length} tokens; cannot continue at {start}")
        return self

    def entry_format(self, head_dim: int, rope: int, dtype: torch.dtype) -> EntryFormat:
        if self.ring_fmt is None:
            self.ring_fmt = EntryFormat(head_dim, rope, self.entry_code, dtype)
        return self.ring_fmt

    def key_format(self, index_dim: int, dtype: torch.dtype):
        return key_format(index_dim, self.index_code, dtype)

    def window(self, B: int, size: int, fmt: EntryFormat, device) -> Ring:
        if self.ring is None:
            self.ring = Ring(B, size, fmt.row_bytes, device)
            if self.marked is not None:  # made after a mark: it was empty there
                self.ring.mark(self.marked)
        return self.ring

    def bytes_in_use(self) -> int:
        return (self.ring.nbytes() if self.ring else 0) + sum(s.bytes_in_use() for s in self.stores())

    def nbytes(self) -> int:
        return (self.ring.nbytes() if self.ring else 0) + sum(s.nbytes() for s in self.stores())

    def host_bytes(self) -> int:
        return self.stores()[0].host_bytes()

    def fetched(self) -> int:  # bytes of host-tier rows copied to the device so far
        entries = self.stores()[0]
        return entries.store.fetched if entries.store is not None else 0


@dataclass
class V4LayerState(LayerRows):
    """One V4 layer's cache: the attention's compressor and, on CSA layers, the indexer's."""
    compressor: CompressorState = field(default_factory=CompressorState)
    indexer: CompressorState = field(default_factory=CompressorState)

    def stores(self) -> tuple[CompressorState, CompressorState]:
        return self.compressor, self.indexer

    def mark(self) -> None:
        """Remember this layer at its length: `rewind` can go back to it, or to any length since."""
        self.marked = self.length
        if self.ring is not None:
            self.ring.mark(self.length)
        self.compressor.mark()
        self.indexer.mark()

    def rewind(self, n: int) -> None:
        """This layer as the first n tokens left it (marked length <= n <= length)."""
        if self.marked is None or not self.marked <= n <= self.length:
            raise EngineError(f"DeepSeek-V4 cache holds {self.length} tokens; it cannot go back to {n} "
                              f"(marked at {self.marked})")
        if self.ring is not None:
            self.ring.rewind(self.length, n)
        for state in (self.compressor, self.indexer):
            if state.store is not None:  # a compressor this layer has
                state.rewind(n - self.marked)
            state.saved = state.journal = None
        self.length, self.marked = n, None
        if self.ring is not None:
            self.ring.saved = None
            self.ring.journal.clear()


class V4Cache:
    """The cache Model.new_cache makes for the mHC block kind (engine/models/registry.py): the API generate, chat
    and the pipeline use (begin / commit / length / reset), over one V4LayerState per layer of the stage.
    `kv.kv_dtype` picks the rows' codes (kconvert.kv_rows.LATENT_CODE for K=V rows, INDEX_CODE for
    indexer keys). `kv.device_budget` turns the host tier on: CSA layers' entries (the bulk: one per 4 tokens)
    live in host memory and a decode step copies only the `index_topk` rows each CSA layer's indexer chose;
    windows, indexer keys, HCA entries and compressor state stay on the device, within that budget (checked
    after each step). `--kv-budget` is the MLA cache's only."""

    def __init__(self, num_layers: int, batch: int, max_len: int, device="cpu", kv: KVOptions | None = None):
        kv = kv or KVOptions()
        if kv.budget:
            raise UsageError("the DeepSeek-V4 cache takes --kv-dtype and --kv-device-budget: --kv-budget is the "
                             "MLA cache's (V4's size per sequence: kconvert plan)")
        self.codes = row_codes(check_kv_dtype(kv.kv_dtype), kv.index_dtype)
        self.device_budget = kv.device_budget
        self.batch, self.max_len, self.device = batch, max_len, torch.device(device)
        self.layers = [self._layer() for _ in range(num_layers)]
        self.lengths = [0] * batch
        self.step: Step | None = None
        self.marked: int | None = None  # the length at mark() (speculative decoding's verify step)

    @property
    def length(self) -> int:
        return max(self.lengths)

    @length.setter
    def length(self, n: int) -> None:
        if n == 0:
            self.reset()
        elif n != self.length:
            raise EngineError(f"DeepSeek-V4 cache holds {self.length} tokens; it cannot be cut to {n} "
                              "(its compressors' state rewinds only to a mark: V4Cache.mark / rollback)")

    @torch.inference_mode()  # the state was made by inference-mode forwards
    def mark(self) -> None:
        """Remember every layer at this length: `rollback` may then go back to it or to any length since."""
        for s in self.layers:
            s.mark()
        self.marked = self.length

    @torch.inference_mode()  # the state was made by inference-mode forwards
    def rollback(self, n: int) -> None:
        """Drop the tokens past n (marked length <= n <= length): the cache is what n tokens alone leave."""
        if self.marked is None or not self.marked <= n <= self.length:
            raise EngineError(f"DeepSeek-V4 cache holds {self.length} tokens; it cannot go back to {n} "
                              f"(marked at {self.marked})")
        for s in self.layers:
            s.rewind(n)
        self.lengths = [n] * self.batch
        self.marked = None

    def ensure(self, tokens: int) -> None:
        if tokens > self.max_len:
            raise EngineError(f"sequence of {tokens} tokens exceeds the cache ({self.max_len} tokens)")

    def reset(self) -> None:
        self.layers = [self._layer() for _ in self.layers]
        self.lengths = [0] * self.batch
        self.marked = None

    def _layer(self) -> V4LayerState:
        return V4LayerState(*self.codes, host_entries=self.device_budget is not None)

    def _states(self) -> list[LayerRows]:
        """Each layer's rows (V4.1's cache holds views of them)."""
        return self.layers

    def device_bytes(self) -> int:
        return self.bytes_in_use() - sum(s.host_bytes() for s in self._states())

    def fetched(self) -> int:
        return sum(s.fetched() for s in self._states())

    def bytes_in_use(self) -> int:
        """Bytes of every row and state held: kconvert.plan's context_bytes(length) x batch."""
        return sum(s.bytes_in_use() for s in self._states())

    def nbytes(self) -> int:
        """Bytes allocated (entry pages grow by 1/4: at most 25 % + a page over `bytes_in_use`)."""
        return sum(s.nbytes() for s in self._states())

    def begin(self, S: int, seqs: list[int] | None = None, owned: bool = True) -> Step:
        seqs = list(range(self.batch)) if seqs is None else list(seqs)
        if seqs != list(range(self.batch)) or len(set(self.lengths)) > 1:
            raise EngineError("the DeepSeek-V4 cache runs every sequence of its batch in lock-step")
        start = self.lengths[0]
        self.ensure(start + S)
        positions = (start + torch.arange(S))[None].expand(self.batch, S).to(self.device)
        # V4 layers address their own rows (ring slots, entry numbers): no map of every position (O(length) a step)
        self.step = Step(seqs, positions, positions, positions, owned)
        return self.step

    def commit(self, step: Step) -> None:
        for b, p in zip(step.seqs, step.positions[:, -1].tolist()):
            self.lengths[b] = p + 1
        self.step = None
        if self.device_budget is not None and self.device_bytes() > self.device_budget:
            raise EngineError(f"KV device budget exhausted: the DeepSeek-V4 cache's device part holds "
                              f"{self.device_bytes()} B at {self.length} tokens, over --kv-device-budget "
                              f"{self.device_budget} B; raise it or shorten the context")
