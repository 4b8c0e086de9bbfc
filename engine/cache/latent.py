"""Paged decode cache: per token and layer one MLA latent row (latent + rope key) and one DSA indexer-key
row, stored as byte rows (engine/cache/row_format.py: bf16, fp8 or int8) in pages of PAGE tokens (docs/KV_CACHE.md).

Every sequence has a page table of logical page ids; pages come from a pool on demand and go back when a
sequence is released or truncated. The pool is bounded by a byte budget, never by max_position_embeddings
(`max_len` only limits positions). With a device budget (engine/cache/tier.py) the oldest latent pages live in
host memory; indexer keys always stay on the device. Nothing is allocated before the first token."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import TextConfig
from engine.cache.row_format import RowFormat, check_kv_dtype, row_codes
from engine.cache.tier import PAGE, Placement, Tier, grow_rows, take_rows
from kconvert.errors import EngineError, UsageError


@dataclass
class KVOptions:
    kv_dtype: str | None = None  # None: the compute dtype; "bf16" | "fp8" | "int8"
    budget: int | None = None  # bytes of the whole cache (device + host); None: unbounded
    device_budget: int | None = None  # bytes of latent pages on the device; None: no host tier
    index_dtype: str | None = None  # the indexer key's code if not kv_dtype's own (measurements, tests)


@dataclass
class Step:
    """One forward call: which sequences, where their new tokens go, and the rows of every position."""
    seqs: list[int]
    positions: torch.Tensor  # [B,S] positions of the new tokens
    rows: torch.Tensor  # [B,T] logical row of positions 0..T-1 (padding rows past a sequence's end)
    write_rows: torch.Tensor  # [B,S]
    owned: bool  # opened by Model.forward (else by a direct layer call)


class LayerKV:
    """One layer's storage: latent rows (device slots + host tier), indexer rows (device, by logical row)."""

    def __init__(self, cache: "KVCache"):
        self.cache = cache
        self.index = torch.zeros(0, cache.idx_fmt.row_bytes if cache.idx_fmt else 0, dtype=torch.uint8,
                                 device=cache.device)
        self.tier = Tier(cache, cache.lat_fmt.row_bytes)

    @property
    def latent(self) -> torch.Tensor:
        return self.tier.dev

    def step_for(self, start: int, B: int, S: int) -> Step:
        return self.cache.step_for(start, B, S)

    def write(self, step: Step, latent: torch.Tensor, k_rope: torch.Tensor) -> None:
        self.tier.write(step.write_rows.reshape(-1), self.cache.lat_fmt.encode(latent, k_rope).flatten(0, 1))

    def read(self, rows: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(latent [..., kv_lora_rank], k_rope [..., rope]) of logical rows [...]."""
        return self.cache.lat_fmt.decode(self.tier.gather(rows), dtype)

    def write_index(self, step: Step, keys: torch.Tensor) -> None:
        need = int(step.write_rows.max()) + 1
        self.index = grow_rows(self.index, need, self.cache.device)
        self.index[step.write_rows.reshape(-1)] = self.cache.idx_fmt.encode(keys).flatten(0, 1)

    def read_index(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.cache.idx_fmt.decode(take_rows(self.index, rows), dtype)[0]


class KVCache:
    def __init__(self, cfg: TextConfig, batch: int, max_len: int, dtype: torch.dtype, device="cpu",
                 reserve: int | None = None, kv: KVOptions | None = None):
        kv = kv or KVOptions()
        check_kv_dtype(kv.kv_dtype)
        self.cfg, self.dtype, self.device, self.kv = cfg, dtype, torch.device(device), kv
        self.max_len, self.batch = max_len, batch
        lat_code, idx_code = row_codes(kv.kv_dtype, kv.index_dtype)
        self.lat_fmt = RowFormat(cfg.kv_lora_rank, cfg.qk_rope_head_dim, lat_code, dtype)
        self.idx_fmt = RowFormat(cfg.index_head_dim, 0, idx_code, dtype) if cfg.index_topk else None
        self.latent_bytes_per_token = cfg.num_layers * self.lat_fmt.row_bytes
        self.bytes_per_token = self.latent_bytes_per_token + cfg.num_layers * (
            self.idx_fmt.row_bytes if self.idx_fmt else 0)
        # (a stage of KDA layers only keeps no rows: nothing for a budget to bound)
        self.max_pages = None if kv.budget is None or not self.bytes_per_token else kv.budget // (PAGE * self.bytes_per_token)
        if self.max_pages is not None and self.max_pages < batch:
            raise UsageError(f"--kv-budget {kv.budget} B holds {self.max_pages} pages of {PAGE} tokens "
                             f"({PAGE * self.bytes_per_token} B each): less than one per sequence")
        self.tables: list[list[int]] = [[] for _ in range(batch)]
        self.lengths = [0] * batch
        self.free_ids: list[int] = []
        self.next_id = 0
        self.step: Step | None = None
        self.placement = Placement(self)
        self.layers = [LayerKV(self) for _ in range(cfg.num_layers)]
        self.latent_layers = list(self.layers)  # the paged ones (a hybrid cache keeps other layers' states too)
        if reserve:
            self.ensure(reserve)

    # ---- compatibility with the single-sequence API -------------------------------------------
    @property
    def length(self) -> int:
        return max(self.lengths)

    @length.setter
    def length(self, n: int) -> None:
        """Keep the first n tokens of every sequence (pages past them go back to the pool)."""
        for b in range(self.batch):
            self.truncate(b, n)

    @property
    def capacity(self) -> int:
        return PAGE * self.pages_in_use

    @property
    def pages_in_use(self) -> int:
        return sum(len(t) for t in self.tables)

    def ensure(self, tokens: int) -> None:
        """Check `tokens` fit; pages are taken as tokens arrive, not here."""
        if tokens > self.max_len:
            raise EngineError(f"sequence of {tokens} tokens exceeds the cache ({self.max_len} tokens)")

    def reset(self) -> None:
        for b in range(self.batch):
            self.release(b)

    def nbytes(self) -> int:
        """Bytes allocated (device + host + hot pages): grows with the tokens in use, up to the budget."""
        return sum(l.index.numel() + l.tier.nbytes() for l in self.latent_layers)

    def bytes_in_use(self) -> int:
        return self.pages_in_use * PAGE * self.bytes_per_token

    # ---- pages --------------------------------------------------------------------------------
    def release(self, seq: int) -> None:
        """A sequence ended: its pages go back to the pool."""
        self.truncate(seq, 0)

    def mark(self) -> None:
        """Speculative decoding's verify step begins (V4Cache's interface): rows are rewound by `truncate`,
        which needs no mark here (rewritten rows replace the dropped ones; DSA keys live by row too)."""

    def rollback(self, n: int) -> None:
        """Drop every sequence's tokens past n (speculative decoding's rejected drafts)."""
        if n > self.length:
            raise EngineError(f"cache holds {self.length} tokens; cannot roll back to {n}")
        self.length = n

    def truncate(self, seq: int, n: int) -> None:
        keep = -(-n // PAGE)
        for pid in self.tables[seq][keep:]:
            self.placement.free(pid)
            self.free_ids.append(pid)
        del self.tables[seq][keep:]
        self.lengths[seq] = min(self.lengths[seq], n)
        self.step = None

    def _new_page(self) -> int:
        if self.max_pages is not None and self.pages_in_use >= self.max_pages:
            raise EngineError(f"KV cache budget exhausted: {self.max_pages} pages of {PAGE} tokens "
                              f"({self.kv.budget} B); raise --kv-budget or shorten the context")
        pid = self.free_ids.pop() if self.free_ids else self.next_id
        self.next_id = max(self.next_id, pid + 1)
        self.placement.place(pid)
        return pid

    # ---- steps --------------------------------------------------------------------------------
    def begin(self, S: int, seqs: list[int] | None = None, owned: bool = True) -> Step:
        """Take pages for S new tokens of each sequence in `seqs` (default: all) and describe the step."""
        seqs = list(range(self.batch)) if seqs is None else list(seqs)
        starts = [self.lengths[b] for b in seqs]
        for b, s0 in zip(seqs, starts):
            if s0 + S > self.max_len:
                raise EngineError(f"sequence of {s0 + S} tokens exceeds the cache ({self.max_len} tokens)")
            while len(self.tables[b]) * PAGE < s0 + S:
                self.tables[b].append(self._new_page())
        T = max(starts) + S
        npages = -(-T // PAGE)
        table = torch.tensor([self.tables[b] + [self.tables[b][0]] * (npages - len(self.tables[b])) for b in seqs])
        pos = torch.arange(T)
        rows = (table[:, pos // PAGE] * PAGE + pos % PAGE)
        positions = torch.tensor(starts)[:, None] + torch.arange(S)
        write_rows = rows.gather(1, positions)
        dev = self.device
        self.step = Step(seqs, positions.to(dev), rows.to(dev), write_rows.to(dev), owned)
        return self.step

    def step_for(self, start: int, B: int, S: int) -> Step:
        """The step a layer runs in: the one Model.forward opened, or (a layer called directly, as
        verify does) one for B sequences at `start`."""
        st = self.step
        if st is not None and st.positions.shape == (B, S) and (
                st.owned or bool((st.positions[:, 0] == start).all())):
            return st
        if B != self.batch:
            raise EngineError(f"{B} sequences for a cache of {self.batch}")
        self.length = start
        return self.begin(S, owned=False)

    def commit(self, step: Step) -> None:
        for b, p in zip(step.seqs, step.positions[:, -1].tolist()):
            self.lengths[b] = p + 1
        self.step = None
