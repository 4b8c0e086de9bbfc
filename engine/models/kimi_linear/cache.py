"""The decode cache of a model whose layers mix KDA (linear attention) and MLA (Kimi Linear, Kimi K3).

A KDA layer keeps no per-token rows: per sequence it holds a fixed-size state, the last kernel-1 inputs of its
short convolutions ([K-1, 3 · heads · head_dim], the compute dtype) and the recurrent matrix ([heads, Dk, Dv],
float32), whatever the context length: that is what makes a 1M-token context affordable. MLA layers page their
latent rows as every MLA model does (engine/cache/latent.py); only they count in the per-token bytes and the
budget. A state cannot be rewound to an earlier token (it is not a list of rows): truncating a sequence to
anything but its start is refused, not silently wrong; a sequence that starts again at position 0 starts from
a zero state."""

from __future__ import annotations

from dataclasses import replace

import torch

from engine.cache.latent import KVCache, KVOptions, Step
from engine.config import TextConfig
from kconvert.errors import EngineError


class RecurrentState:
    """One KDA layer's state for every sequence of the cache (allocated at its first write)."""

    def __init__(self, cache: "HybridCache"):
        self.cache = cache
        self.conv: torch.Tensor | None = None  # [batch, K-1, C]
        self.state: torch.Tensor | None = None  # [batch, heads, Dk, Dv] float32

    def step_for(self, start: int, B: int, S: int) -> Step:
        return self.cache.step_for(start, B, S)

    def read(self, step: Step) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(conv window, state) of the step's sequences; zeros for a sequence at its first token."""
        if self.state is None:
            return None, None
        idx = torch.tensor(step.seqs).to(self.state.device)
        fresh = (step.positions[:, 0] == 0).to(self.state.device)
        conv, state = self.conv[idx], self.state[idx]
        if bool(fresh.any()):
            conv = conv.masked_fill(fresh[:, None, None], 0)
            state = state.masked_fill(fresh[:, None, None, None], 0)
        return conv, state

    def write(self, step: Step, conv: torch.Tensor, state: torch.Tensor) -> None:
        if self.state is None:
            batch = self.cache.batch
            self.conv = conv.new_zeros(batch, *conv.shape[1:])
            self.state = state.new_zeros(batch, *state.shape[1:], dtype=torch.float32)
        idx = torch.tensor(step.seqs).to(self.state.device)
        self.conv[idx] = conv.to(self.conv.dtype)
        self.state[idx] = state.float()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.state) if t is not None)


class HybridCache(KVCache):
    """KVCache over the MLA layers of a stage, with a RecurrentState in each KDA layer's slot: `layers[i]` is the
    stage's i-th layer's (LayerKV or RecurrentState), `latent_layers` the paged ones."""

    def __init__(self, cfg: TextConfig, kinds: list[str], batch: int, max_len: int, dtype: torch.dtype,
                 device="cpu", reserve: int | None = None, kv: KVOptions | None = None):
        mla = sum(k != "kda" for k in kinds)
        super().__init__(replace(cfg, num_layers=mla), batch, max_len, dtype, device, reserve, kv)
        paged = iter(self.latent_layers)
        self.layers = [RecurrentState(self) if k == "kda" else next(paged) for k in kinds]
        self.kinds = list(kinds)

    @property
    def states(self) -> list[RecurrentState]:
        return [layer for layer, k in zip(self.layers, self.kinds) if k == "kda"]

    def nbytes(self) -> int:
        return super().nbytes() + sum(s.nbytes() for s in self.states)

    def truncate(self, seq: int, n: int) -> None:
        if 0 < n < self.lengths[seq] and self.states:
            raise EngineError(f"sequence {seq} cannot go back to token {n}: KDA layers keep a state, not rows "
                              "(only a restart from the first token is possible)")
        super().truncate(seq, n)
