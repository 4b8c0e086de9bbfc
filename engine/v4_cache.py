"""A dense per-layer decode cache for DeepSeek-V4 (the long-context paged cache is another issue).

Per layer it holds what the next token needs and nothing it can recompute: the last `window - 1` shared
K=V rows of the sliding branch and, per compressor (the attention's and, on CSA layers, the indexer's),
the compressed entries so far, the projected rows of the window still filling up, and the previous
window's first-series rows (CSA windows overlap). Every sequence of a batch moves in lock-step (same
length): the compressors' state cannot be rewound, so the cache is kept only at its length or reset to 0."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.cache import Step
from kconvert.errors import EngineError


@dataclass
class CompressorState:
    entries: torch.Tensor | None = None  # [B, n, dim] compressed entries, RoPE applied
    kv: torch.Tensor | None = None  # [B, <rate, width] projected rows of the window still filling up
    gate: torch.Tensor | None = None
    overlap: tuple[torch.Tensor, torch.Tensor] | None = None  # CSA: last full window's (kv, gate) first series
    count: int = 0  # entries emitted: the next window starts at token count * rate

    def take(self, kv: torch.Tensor, gate: torch.Tensor, rate: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(rows of the complete windows, their gates, the first one's token position); keeps the rest."""
        first = self.count * rate
        if self.kv is not None:
            kv, gate = torch.cat([self.kv, kv], 1), torch.cat([self.gate, gate], 1)
        full = kv.shape[1] // rate * rate
        self.kv, self.gate = kv[:, full:], gate[:, full:]
        return kv[:, :full], gate[:, :full], first

    def append(self, new: torch.Tensor) -> torch.Tensor:
        self.entries = new if self.entries is None else torch.cat([self.entries, new], 1)
        self.count += new.shape[1]
        return self.entries


@dataclass
class V4LayerState:
    length: int = 0  # tokens seen
    window: torch.Tensor | None = None  # [B, <= window-1, head_dim] last K=V rows of the sliding branch
    compressor: CompressorState = field(default_factory=CompressorState)
    indexer: CompressorState = field(default_factory=CompressorState)

    def at(self, start: int) -> "V4LayerState":
        """This layer's state for tokens from `start`: a new sequence (start 0) clears it."""
        if start == 0 and self.length:
            self.__init__()
        if start != self.length:
            raise EngineError(f"DeepSeek-V4 cache holds {self.length} tokens; cannot continue at {start}")
        return self


class V4Cache:
    """The cache Model.new_cache makes for the mHC block kind (engine/layers.py): the API generate, chat
    and the pipeline use (begin / commit / length / reset), over one V4LayerState per layer of the stage."""

    def __init__(self, num_layers: int, batch: int, max_len: int, device="cpu"):
        self.batch, self.max_len, self.device = batch, max_len, torch.device(device)
        self.layers = [V4LayerState() for _ in range(num_layers)]
        self.lengths = [0] * batch
        self.step: Step | None = None

    @property
    def length(self) -> int:
        return max(self.lengths)

    @length.setter
    def length(self, n: int) -> None:
        if n == 0:
            self.reset()
        elif n != self.length:
            raise EngineError(f"DeepSeek-V4 cache holds {self.length} tokens; it cannot be cut to {n} "
                              "(its compressors' state does not rewind)")

    def ensure(self, tokens: int) -> None:
        if tokens > self.max_len:
            raise EngineError(f"sequence of {tokens} tokens exceeds the cache ({self.max_len} tokens)")

    def reset(self) -> None:
        self.layers = [V4LayerState() for _ in self.layers]
        self.lengths = [0] * self.batch

    def begin(self, S: int, seqs: list[int] | None = None, owned: bool = True) -> Step:
        seqs = list(range(self.batch)) if seqs is None else list(seqs)
        if seqs != list(range(self.batch)) or len(set(self.lengths)) > 1:
            raise EngineError("the DeepSeek-V4 dense cache runs every sequence of its batch in lock-step")
        start = self.lengths[0]
        self.ensure(start + S)
        positions = (start + torch.arange(S))[None].expand(self.batch, S).to(self.device)
        rows = torch.arange(start + S, device=self.device)[None].expand(self.batch, -1)
        self.step = Step(seqs, positions, rows, positions, owned)
        return self.step

    def commit(self, step: Step) -> None:
        for b, p in zip(step.seqs, step.positions[:, -1].tolist()):
            self.lengths[b] = p + 1
        self.step = None
