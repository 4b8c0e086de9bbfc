"""DeepSeek-V4.1's decode cache: V4's (engine/models/deepseek_v4/cache.py: lock-step batches, the window ring, paged
entries in the --kv-dtype's code) with V4.1's roles.

Per layer: the sliding window's ring; on a KV source, its compressed entries (RoPE applied) and its compressor's
running state (the rows of the group still filling up, float32); on a source that also indexes, its index keys;
and for the stage's Engram layers the compressed ids of the last `max_ngram - 1` tokens (what the next tokens'
n-grams look back to). Layers that read another layer's entries or keys hold none: the stage's `Handoff` names the states by
layer, and carries what an indexer chose for this forward's tokens (and the candidate blocks) to the layers after
it. Under pipeline parallelism a stage keeps `mirrors` of the earlier stages' sources, filled from what the stage
before sends (engine/models/deepseek_v41/crossing.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.models.deepseek_v4.cache import LayerRows, V4Cache
from engine.models.deepseek_v4.compressor_state import CompressorState
from kconvert.errors import EngineError

DEAD = -1  # an Engram look-back position no n-gram may span (before the sequence, an image token)


@dataclass
class V41LayerState(LayerRows):
    """One V4.1 layer's cache: a KV source's entries and pending rows, an index-key owner's keys (store only)."""
    entries: CompressorState = field(default_factory=CompressorState)
    keys: CompressorState = field(default_factory=CompressorState)

    family = "DeepSeek-V4.1"

    def stores(self) -> tuple[CompressorState, CompressorState]:
        return self.entries, self.keys

    def mark(self) -> None:
        """Remember this layer at its length (speculative decoding's round): `rewind` goes back to it or later."""
        self.marked = self.length
        if self.ring is not None:
            self.ring.mark(self.length)
        for state in (self.entries, self.keys):
            if state.store is not None:
                state.mark()

    def rewind(self, n: int, ratio: int, mirror: bool = False) -> None:
        """This layer as the first n tokens left it (marked length <= n <= length). `ratio`: its compression; a
        `mirror` (this stage's copy of an earlier stage's source: stores only, no length of its own). Entries are one
        per `ratio` tokens from the sequence's start, so both stores keep n // ratio; a pooling source also gets back
        the rows of its group still filling (its journal)."""
        if not mirror and (self.marked is None or not self.marked <= n <= self.length):
            raise EngineError(f"DeepSeek-V4.1 cache holds {self.length} tokens; it cannot go back to {n} "
                              f"(marked at {self.marked})")
        if self.ring is not None:
            self.ring.rewind(self.length, n)
            self.ring.saved = None
            self.ring.journal.clear()
        for state in (self.entries, self.keys):
            if state.store is None:
                continue
            if state is self.entries and ratio > 1 and not mirror and state.journal is not None and state.journal[0]:
                state.rewind(n - self.marked)  # a pooling source's own state: its pending rows from the journal
            else:
                keep = n // max(ratio, 1)
                state.store.truncate(keep)
                state.count = keep
            state.saved = state.journal = None
        self.length, self.marked = (self.length if mirror else n), None


@dataclass
class Handoff:
    """What the layers of a stage share: every layer's state by model layer (a stage's own and its mirrors of earlier
    stages' sources), and for this forward's tokens each indexer's choice and the candidate blocks."""

    states: dict = field(default_factory=dict)  # model layer -> V41LayerState
    chosen: dict = field(default_factory=dict)  # indexer layer -> (entries [B, S, k], valid [B, S, k])
    candidates: torch.Tensor | None = None  # [B, S, n] bool: the candidate source's blocks, per entry
    hashes: object = None  # engine.models.deepseek_v41.engram.EngramHashes (Engram layers)
    history: torch.Tensor | None = None  # [B, max_ngram - 1]: the compressed ids before this forward's tokens
    rows: torch.Tensor | None = None  # this forward's Engram rows [B, S, layers, cols]
    saved_history: list | None = None  # mark(): [the history then, the compressed ids of each forward since]

    def engram_rows(self, ids: torch.Tensor | None, image: torch.Tensor | None, start: int) -> torch.Tensor:
        """Every Engram layer's table rows for this forward's tokens (hashed once a forward: the stage's first
        Engram layer), the look-back history moved on."""
        if self.rows is None:
            if ids is None or self.hashes is None:
                raise EngineError("DeepSeek-V4.1's Engram layers need the token ids and engram_token_map.json")
            back = self.hashes.max_ngram - 1
            if start == 0 or self.history is None:
                self.history = torch.full((ids.shape[0], back), DEAD, dtype=torch.long, device=ids.device)
            current = self.hashes.compress(ids, None if image is None else ~image)
            if self.saved_history is not None:
                self.saved_history.append(current)
            self.rows = self.hashes.rows(self.history, current)
            self.history = torch.cat([self.history, current], 1)[:, current.shape[1]:] if back else self.history
        return self.rows

    def mark(self) -> None:
        self.saved_history = [self.history] if self.history is not None else None

    def rewind(self, keep: int) -> None:
        """The look-back history after the first `keep` tokens since the mark."""
        if self.saved_history is not None:
            back = self.history.shape[1]
            ids = torch.cat(self.saved_history, 1)[:, :back + keep]
            self.history = ids[:, ids.shape[1] - back:]
        self.saved_history = None

    def state(self, layer: int) -> V41LayerState:
        if layer not in self.states:
            raise EngineError(f"DeepSeek-V4.1 layer {layer}'s state is not on this stage (no crossing received)")
        return self.states[layer]


class V41LayerView:
    """One layer's cache as its block sees it: its own state, and the stage's handoff."""

    def __init__(self, state: V41LayerState, handoff: Handoff):
        self.state, self.handoff = state, handoff


class V41Cache(V4Cache):
    """V4Cache's API (begin / commit / length / reset, --kv-dtype, the host tier) over the V4.1 layer states of a
    stage's `layers` (model layer numbers); `cache.layers[i]` is layer layers[i]'s view."""

    def __init__(self, layers: list[int], batch: int, max_len: int, device="cpu", kv=None, hashes=None,
                 ratios: tuple[int, ...] = ()):
        self.layer_ids, self.hashes, self.ratios = list(layers), hashes, tuple(ratios)
        self.handoff = Handoff(hashes=hashes)
        super().__init__(len(layers), batch, max_len, device, kv)
        self._share()

    def reset(self) -> None:
        self.handoff = Handoff(hashes=self.hashes)
        super().reset()
        self._share()

    def _share(self) -> None:
        """Every view on the current handoff, which names every layer's state (a forward that runs the layers
        without begin / commit, as verify's per-layer states do, finds them too)."""
        for L, view in zip(self.layer_ids, self.layers):
            view.handoff = self.handoff
            self.handoff.states[L] = view.state

    def _layer(self) -> V41LayerView:
        return V41LayerView(V41LayerState(*self.codes, host_entries=self.device_budget is not None), self.handoff)

    def begin(self, S: int, seqs=None, owned: bool = True):
        step = super().begin(S, seqs, owned)
        self.handoff.chosen.clear()
        self.handoff.candidates = self.handoff.rows = None
        return step

    @torch.inference_mode()
    def mark(self) -> None:
        """Remember every layer's state (the stage's own and its mirrors of earlier sources) at this length."""
        for state in self.handoff.states.values():
            state.mark()
        self.handoff.mark()
        self.marked = self.length

    @torch.inference_mode()
    def rollback(self, n: int) -> None:
        """Drop the tokens past n (marked length <= n <= length): the cache is what n tokens alone leave."""
        if self.marked is None or not self.marked <= n <= self.length:
            raise EngineError(f"DeepSeek-V4.1 cache holds {self.length} tokens; it cannot go back to {n} "
                              f"(marked at {self.marked})")
        for L, state in self.handoff.states.items():
            state.rewind(n, self.ratios[L] if L < len(self.ratios) else 0, mirror=L not in self.layer_ids)
        self.handoff.rewind(n - self.marked)
        self.lengths = [n] * self.batch
        self.marked = None

    def _states(self) -> list[V41LayerState]:
        return [v.state for v in self.layers]
