"""Storage of DeepSeek-V4's cache: byte rows per sequence of a lock-step batch (engine/models/deepseek_v4/entry_format.py encodes them).

`PagedRows` holds a growing list of rows (compressed entries, indexer keys) in pages of PAGE rows: storage
grows by whole pages, 1/4 at a time (appends stay O(1) amortized, at most 25 % + one page over the rows in
use), and reads are views or row gathers, never a concatenation of everything so far. `Ring` holds a sliding
window's last `size` rows: row of position p at slot p % size, written in place.

Both rewind (speculative decoding drops the tokens the target rejected): `PagedRows.truncate` forgets rows past
a count; a marked `Ring` keeps the rows written since its mark (the last `size + REWIND` of them) and restores
the window of any position back to the mark from them and a copy of the ring taken at the mark."""

from __future__ import annotations

from collections import deque

import torch

from engine.cache.tier import PAGE


class PagedRows:
    """Rows on `device`; with `host` set, stored in host memory (pinned where the device allows) and each read
    copies only the rows it asks for to `device`, counted in `fetched` (bytes)."""

    def __init__(self, batch: int, row_bytes: int, device, host: bool = False):
        self.device = torch.device(device)
        self.host = host
        where = "cpu" if host else self.device
        self.rows = torch.zeros(batch, 0, row_bytes, dtype=torch.uint8, device=where)
        self.count = 0
        self.fetched = 0

    def append(self, new: torch.Tensor) -> None:
        """new uint8 [B, n, row_bytes] after the rows so far."""
        need = self.count + new.shape[1]
        cap = self.rows.shape[1]
        if need > cap:
            grown = max(need, cap + cap // 4)
            grown = -(-grown // PAGE) * PAGE
            rows = self.rows.new_zeros(self.rows.shape[0], grown, self.rows.shape[2])
            if self.host and self.device.type != "cpu":
                rows = _pinned(rows)
            rows[:, :self.count] = self.rows[:, :self.count]
            self.rows = rows
        self.rows[:, self.count:need] = new
        self.count = need

    def truncate(self, count: int) -> None:
        """Keep the first `count` rows (the storage stays; the rows past it are written over by later appends)."""
        if not 0 <= count <= self.count:
            raise ValueError(f"cannot keep {count} of {self.count} rows")
        self.count = count

    def all(self) -> torch.Tensor:
        """[B, count, row_bytes] on the device: a view of the rows in use (with `host`, all of them copied)."""
        return self._arrive(self.rows[:, :self.count])

    def take(self, index: torch.Tensor) -> torch.Tensor:
        """index [B, ...] of row numbers -> [B, ..., row_bytes] on the device: only these rows are read."""
        B = index.shape[0]
        flat = index.reshape(B, -1).to(self.rows.device)
        got = torch.stack([self.rows[b].index_select(0, flat[b]) for b in range(B)]) if B > 1 else \
            self.rows[0].index_select(0, flat[0])[None]
        return self._arrive(got.view(*index.shape, self.rows.shape[2]))

    def _arrive(self, rows: torch.Tensor) -> torch.Tensor:
        if not self.host:
            return rows
        self.fetched += rows.numel()
        return rows.to(self.device, non_blocking=True)

    def bytes_in_use(self) -> int:
        return self.rows.shape[0] * self.count * self.rows.shape[2]

    def nbytes(self) -> int:
        return self.rows.numel()


def _pinned(t: torch.Tensor) -> torch.Tensor:
    try:
        return t.pin_memory()
    except RuntimeError:  # no page-locking on this build: plain host memory still works
        return t


REWIND = 64  # tokens a marked ring can go back from its newest position (speculative steps are a few tokens)


class Ring:
    """The last `size` rows of a sliding window; allocated at the first write."""

    def __init__(self, batch: int, size: int, row_bytes: int, device):
        self.shape, self.device = (batch, size, row_bytes), device
        self.rows: torch.Tensor | None = None
        self.saved: tuple[int, torch.Tensor | None] | None = None  # (position of the mark, the ring then)
        self.journal: deque[tuple[int, torch.Tensor]] = deque()  # (first position, rows) written since the mark

    def mark(self, end: int) -> None:
        """Remember the ring at `end` tokens so `rewind` can go back to any position from here on."""
        self.saved = (end, None if self.rows is None else self.rows.clone())
        self.journal.clear()

    def rewind(self, end: int, n: int) -> None:
        """The ring as it was at `n` tokens (mark <= n <= end, the current position), rows past n dropped."""
        if self.saved is None or not self.saved[0] <= n <= end:
            raise ValueError(f"ring at {end} tokens cannot rewind to {n} (mark: {self.saved and self.saved[0]})")
        mark, rows = self.saved
        size = self.shape[1]
        need = max(mark, n - size)  # the oldest position the window at n takes from the journal
        if self.journal and self.journal[0][0] > need:
            raise ValueError(f"ring cannot rewind {end - n} tokens (it keeps {REWIND})")
        self.rows = None if rows is None else rows.clone()
        self.saved, journal = (mark, rows), list(self.journal)
        self.journal.clear()
        for first, r in journal:
            lo, hi = max(first, need), min(first + r.shape[1], n)
            if lo < hi:
                self._put(r[:, lo - first:hi - first], hi)
                self.journal.append((lo, r[:, lo - first:hi - first]))

    def read(self, start: int) -> torch.Tensor:
        """[B, min(start, size), row_bytes]: rows of positions max(0, start - size) .. start - 1, in order."""
        size = self.shape[1]
        n = min(start, size)
        if n == 0 or self.rows is None:
            return torch.zeros(self.shape[0], 0, self.shape[2], dtype=torch.uint8, device=self.device)
        slots = torch.arange(start - n, start, device=self.device) % size
        return self.rows.index_select(1, slots)

    def write(self, rows: torch.Tensor, end: int) -> None:
        """rows [B, T, row_bytes] of positions end - T .. end - 1: the last `size` of them are kept."""
        if self.saved is not None:  # marked: keep what a rewind needs (the last size + REWIND rows)
            keep = self.shape[1] + REWIND
            r = rows[:, -keep:].clone()
            self.journal.append((end - r.shape[1], r))
            while self.journal and end - self.journal[0][0] > keep + self.journal[0][1].shape[1]:
                self.journal.popleft()
        self._put(rows, end)

    def _put(self, rows: torch.Tensor, end: int) -> None:
        size = self.shape[1]
        if size == 0:
            return
        if self.rows is None:
            self.rows = torch.zeros(self.shape, dtype=torch.uint8, device=self.device)
        T = min(rows.shape[1], size)
        slots = torch.arange(end - T, end, device=self.device) % size
        self.rows[:, slots] = rows[:, rows.shape[1] - T:]

    def nbytes(self) -> int:
        return 0 if self.rows is None else self.rows.numel()
