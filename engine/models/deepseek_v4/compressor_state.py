"""One compressor's decode state (DeepSeek-V4's attention and indexer compressors, V4.1's KV sources and index-key
owners): its compressed entries in pages (engine/cache/paged_rows.py) in the --kv-dtype's code, and a fixed-size
float32 running state: the projected rows of the window still filling up and, for CSA, the last full window's first
series (windows overlap). Rewindable from a mark (engine/cache/rewind.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.cache.paged_rows import PagedRows
from engine.cache.rewind import Rewindable


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
