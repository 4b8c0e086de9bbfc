"""Going back in a DeepSeek-V4 compressor's state (engine/models/deepseek_v4/cache.py): speculative decoding drops the
tokens its target rejected, and a compressor has folded them into its pending rows, its overlap and maybe a
finished entry. `mark` copies the fixed-size state; from then on the state journals the projected rows each
step adds and the overlap (first series) of each window completed; `rewind(keep)` rebuilds the state the first
`keep` tokens since the mark alone would have left: the windows they complete stay, the rows of the one still
filling are pending again, the overlap is the last kept window's."""

from __future__ import annotations

import torch


class Rewindable:
    """The mark / rewind of CompressorState (its fields: pending_kv / pending_gate [B, rate, width], pending,
    count, store, has_overlap, overlap_kv / overlap_gate, saved, journal; `take` and `keep_overlap` journal)."""

    def mark(self) -> None:
        """Remember the state here (its fixed-size part) and journal what the next steps add."""
        p = self.pending
        copy = lambda t: None if t is None else t.clone()  # noqa: E731
        self.saved = (p, copy(self.pending_kv[:, :p]) if p else None, copy(self.pending_gate[:, :p]) if p else None,
                      self.count, self.store.count if self.store is not None else 0, self.has_overlap,
                      copy(self.overlap_kv), copy(self.overlap_gate))
        self.journal = ([], [], [])

    def rewind(self, keep: int) -> None:
        """The state after the first `keep` tokens since the mark: the windows they complete stay, the rows of the
        one still filling are pending again, the overlap is the last kept window's."""
        if self.saved is None:
            raise ValueError("compressor state rewound without a mark")
        p0, kv0, gate0, count0, stored0, had_overlap, okv0, ogate0 = self.saved
        kvs, gates, overlaps = self.journal
        kv = torch.cat(([kv0] if p0 else []) + kvs, 1)[:, :p0 + keep]
        gate = torch.cat(([gate0] if p0 else []) + gates, 1)[:, :p0 + keep]
        rate = self.pending_kv.shape[1]
        done = (p0 + keep) // rate  # windows completed since the mark that stay
        self.count, self.has_overlap = count0 + done, had_overlap or done > 0
        self.store.truncate(stored0 + done)
        self.pending = p0 + keep - done * rate
        self.pending_kv[:, :self.pending] = kv[:, done * rate:]
        self.pending_gate[:, :self.pending] = gate[:, done * rate:]
        if self.overlap_kv is not None:
            if done:
                okv = torch.cat([k for k, _ in overlaps], 1)[:, done - 1]
                ogate = torch.cat([g for _, g in overlaps], 1)[:, done - 1]
            else:
                okv, ogate = okv0, ogate0
            if okv is not None:
                self.overlap_kv.copy_(okv)
                self.overlap_gate.copy_(ogate)
        self.saved = self.journal = None
