"""DeepSeek-V4's decode cache, sized for a 1M-token context (docs/KV_CACHE.md, "DeepSeek-V4").

Per layer it holds what the next token needs and nothing it can recompute: a ring of the sliding branch's
last `window - 1` K=V rows, and per compressor (the attention's and, on CSA layers, the indexer's) its
compressed entries in pages (engine/cache/paged_rows.py) plus a fixed-size float32 running state: the projected
rows of the window still filling up and, for CSA, the last full window's first series (windows overlap).
Rows are stored in the --kv-dtype's code (engine/cache/entry_format.py); nothing the cache keeps is a view of a
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
from engine.cache.entry_format import EntryFormat, key_format
from engine.cache.paged_rows import PagedRows, Ring
from engine.cache.rewind import Rewindable
from kconvert.errors import EngineError, UsageError


@dataclass
class CompressorState(Rewindable):
    code: str | None = None  # the entries' row code (None: the compute dtype)
    store: PagedRows | None = None  # compressed entries so far, RoPE applied, encoded
    fmt: object = None  # EntryFormat (attention entries) or kv_format.RowFormat (indexer keys)
    pending_kv: torch.Tensor | None = None  # [B, rate, width] float32: rows of the window still filling up
    pending_gate: torch.Tensor | None = None
    pending: int = 0  # rows of it in use
    overlap_kv: torch.Tensor | None = None  # CSA [B, rate, dim] float32: the last full window's first series
    overlap_gate: torch.Tensor | None = None
    has_overlap: bool = False
    count: int = 0  # entries emitted: the next window starts at token count * rate
    saved: tuple | None = None  # mark(): (pending rows, count, overlap) then; the rows added since (rewind)
    journal: list | None = None

    def ready(self, fmt, B: int, rate: int, width: int, dim: int, overlap: bool, device, host: bool = False) -> None:
        """Allocate the fixed-size state at the first call (the byte count plan predicts); `host`: the entries
        live in host memory (the host tier)."""
        if self.store is not None:
            return
        self.fmt = fmt
        self.store = PagedRows(B, fmt.row_bytes, device, host)
        f32 = dict(dtype=torch.float32, device=device)
        self.pending_kv, self.pending_gate = torch.zeros(B, rate, width, **f32), torch.zeros(B, rate, width, **f32)
        if overlap:
            self.overlap_kv, self.overlap_gate = torch.zeros(B, rate, dim, **f32), torch.zeros(B, rate, dim, **f32)

    def take(self, kv: torch.Tensor, gate: torch.Tensor, rate: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(rows of the complete windows, their gates, the first one's token position); copies the rest into
        the pending state (a copy: a view would keep this call's whole projection alive)."""
        first = self.count * rate
        if self.journal is not None:
            self.journal[0].append(kv.float())
            self.journal[1].append(gate.float())
        if self.pending:
            p = self.pending
            kv = torch.cat([self.pending_kv[:, :p].to(kv.dtype), kv], 1)
            gate = torch.cat([self.pending_gate[:, :p].to(gate.dtype), gate], 1)
        full = kv.shape[1] // rate * rate
        self.pending = kv.shape[1] - full
        self.pending_kv[:, :self.pending] = kv[:, full:]
        self.pending_gate[:, :self.pending] = gate[:, full:]
        return kv[:, :full], gate[:, :full], first

    def keep_overlap(self, kv: torch.Tensor, gate: torch.Tensor) -> None:
        """kv, gate [B, n, rate, dim]: the first series of the n windows just completed; the last one is kept."""
        self.overlap_kv.copy_(kv[:, -1])
        self.overlap_gate.copy_(gate[:, -1])
        self.has_overlap = True
        if self.journal is not None:
            self.journal[2].append((kv.float(), gate.float()))

    def append(self, new: torch.Tensor) -> None:
        self.store.append(self.fmt.encode(new))
        self.count += new.shape[1]

    def entries(self, dtype: torch.dtype) -> torch.Tensor:
        """Every entry so far [B, n, dim], decoded."""
        return _decode(self.fmt, self.store.all(), dtype)

    def gather(self, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Entries index [B, ...] -> [B, ..., dim], decoded: only those rows are read."""
        return _decode(self.fmt, self.store.take(index), dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.pending_kv, self.pending_gate, self.overlap_kv, self.overlap_gate) if t is not None]

    def bytes_in_use(self) -> int:
        return (self.store.bytes_in_use() if self.store else 0) + sum(t.numel() * 4 for t in self.tensors())

    def nbytes(self) -> int:
        return (self.store.nbytes() if self.store else 0) + sum(t.numel() * 4 for t in self.tensors())

    def host_bytes(self) -> int:
        return self.store.bytes_in_use() if self.store is not None and self.store.host else 0


def _decode(fmt, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    out = fmt.decode(rows, dtype)
    return out[0] if isinstance(out, tuple) else out


@dataclass
class V4LayerState:
    """One layer's cache. Made alone (a layer called directly, as tests do) it stores the compute dtype."""
    entry_code: str | None = None
    index_code: str | None = None
    host_entries: bool = False  # the host tier: CSA entries in host memory, a step fetches what it attends to
    length: int = 0  # tokens seen
    ring: Ring | None = None  # the sliding branch's last window - 1 K=V rows
    ring_fmt: EntryFormat | None = None
    compressor: CompressorState = field(default_factory=CompressorState)
    indexer: CompressorState = field(default_factory=CompressorState)
    marked: int | None = None  # the length at mark()

    def at(self, start: int) -> "V4LayerState":
        """This layer's state for tokens from `start`: a new sequence (start 0) clears it."""
        if start == 0 and self.length:
            self.__init__(self.entry_code, self.index_code, self.host_entries)
        if start != self.length:
            raise EngineError(f"DeepSeek-V4 cache holds {self.length} tokens; cannot continue at {start}")
        return self

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
        ring = self.ring.nbytes() if self.ring else 0
        return ring + self.compressor.bytes_in_use() + self.indexer.bytes_in_use()

    def nbytes(self) -> int:
        ring = self.ring.nbytes() if self.ring else 0
        return ring + self.compressor.nbytes() + self.indexer.nbytes()

    def fetched(self) -> int:
        """Bytes of host-tier rows copied to the device so far."""
        return self.compressor.store.fetched if self.compressor.store is not None else 0


class V4Cache:
    """The cache Model.new_cache makes for the mHC block kind (engine/models/registry.py): the API generate, chat
    and the pipeline use (begin / commit / length / reset), over one V4LayerState per layer of the stage.
    `kv.kv_dtype` picks the rows' codes (kconvert.plan.kv_bytes.LATENT_CODE for K=V rows, INDEX_CODE for
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

    def device_bytes(self) -> int:
        return self.bytes_in_use() - sum(s.compressor.host_bytes() for s in self.layers)

    def fetched(self) -> int:
        return sum(s.fetched() for s in self.layers)

    def bytes_in_use(self) -> int:
        """Bytes of every row and state held: kconvert.plan's context_bytes(length) x batch."""
        return sum(s.bytes_in_use() for s in self.layers)

    def nbytes(self) -> int:
        """Bytes allocated (entry pages grow by 1/4: at most 25 % + a page over `bytes_in_use`)."""
        return sum(s.nbytes() for s in self.layers)

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
