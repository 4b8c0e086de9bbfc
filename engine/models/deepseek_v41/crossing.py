"""What one DeepSeek-V4.1 pipeline stage sends the next beside the residual: the state its layers (or the stages
before it) made that the layers after the boundary read. A compressed layer reads the entries of the last KV source
before it, an indexer the keys of the last key owner and the candidate blocks, a layer without an indexer the last
indexer's choice (engine/models/deepseek_v41/config.py); when that layer is on an earlier stage, the stage before
sends it: the entries and keys this forward added (as the cache's byte rows: nothing is re-rounded), the choices and
candidate blocks of this forward's tokens. The receiver appends the rows to its mirror of the source's state
(engine/models/deepseek_v41/cache.py) and hands the choices on, so every stage holds what its layers read and computes nothing
twice. Both sides derive the message's layout from the config, the positions and the batch: one uint8 buffer."""

from __future__ import annotations

import torch

from engine.models.deepseek_v4.entry_format import EntryFormat, key_format
from engine.models.deepseek_v41.cache import V41Cache, V41LayerState
from engine.models.deepseek_v41.config import V41Config

ENTRIES, KEYS, CHOSEN, CANDIDATES = "entries", "keys", "chosen", "candidates"


def crossing(c: V41Config, boundary: int) -> list[tuple[str, int]]:
    """(what, its source layer) that layers at or after `boundary` read from layers before it, in a fixed order."""
    need: set[tuple[str, int]] = set()
    for L in range(boundary, len(c.ratios)):
        if not c.attends(L):
            continue  # the window alone: it reads nothing from before (a source's own entries are its own)
        for what, src in ((ENTRIES, c.entries_from[L]), (CHOSEN, c.choice_from[L])):
            if src < boundary:
                need.add((what, src))
        if L in c.indexers:
            need.discard((CHOSEN, L))
            if c.keys_from[L] < boundary:
                need.add((KEYS, c.keys_from[L]))
            if c.uses_candidates(L) and c.candidate_source < boundary:
                need.add((CANDIDATES, c.candidate_source))
    return sorted(need, key=lambda n: (n[1], n[0]))


def _formats(c: V41Config, cache: V41Cache, dtype: torch.dtype) -> tuple[EntryFormat, object]:
    entry_code, index_code = cache.codes
    return EntryFormat(c.head_dim, c.rope_dim, entry_code, dtype), key_format(c.index_head_dim, index_code, dtype)


def _layout(c: V41Config, parts: list[tuple[str, int]], B: int, start: int, S: int, fmts) -> list[tuple]:
    """(what, layer, shape, dtype) of each part of the message for tokens start..start + S."""
    end, out = start + S, []
    for what, L in parts:
        r = c.ratios[L]
        if what in (ENTRIES, KEYS):
            rows = fmts[0].row_bytes if what == ENTRIES else fmts[1].row_bytes
            out.append((what, L, (B, end // r - start // r, rows), torch.uint8))
        elif what == CHOSEN:
            k = min(c.index_topk, end // r)
            out += [(what, L, (B, S, k), torch.int64), (what + "_valid", L, (B, S, k), torch.bool)]
        else:
            out.append((what, L, (B, S, end // r), torch.bool))
    return out


def _nbytes(shape, dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def outgoing(c: V41Config, cache: V41Cache, boundary: int, start: int, S: int, dtype) -> torch.Tensor | None:
    """The message to the stage starting at layer `boundary` (None: nothing crosses)."""
    parts = crossing(c, boundary)
    if not parts:
        return None
    hand, B = cache.handoff, cache.batch
    chunks = []
    for what, L, shape, dt in _layout(c, parts, B, start, S, _formats(c, cache, dtype)):
        if what in (ENTRIES, KEYS):
            state = hand.state(L).entries if what == ENTRIES else hand.state(L).keys
            x = state.store.rows[:, state.count - shape[1]:state.count] if state.store is not None else \
                torch.zeros(shape, dtype=dt)
        elif what == CHOSEN:
            x = hand.chosen[L][0]
        elif what == CHOSEN + "_valid":
            x = hand.chosen[L][1]
        else:
            x = hand.candidates
        chunks.append(x.to(dt).contiguous().reshape(-1).view(torch.uint8))
    return torch.cat(chunks).to(cache.device)


def incoming(c: V41Config, cache: V41Cache, boundary: int, start: int, S: int, dtype, recv) -> None:
    """Receive (recv(nbytes) -> uint8 tensor) and file the message from the stage before the one starting at
    `boundary`: rows onto this stage's mirrors of earlier sources, choices and candidates into the handoff."""
    parts = crossing(c, boundary)
    if not parts:
        return
    fmts = _formats(c, cache, dtype)
    layout = _layout(c, parts, cache.batch, start, S, fmts)
    buf = recv(sum(_nbytes(shape, dt) for _, _, shape, dt in layout))
    hand, at, fresh = cache.handoff, 0, set()
    for what, L, shape, dt in layout:
        n = _nbytes(shape, dt)
        x = buf[at:at + n].clone().view(dt).view(shape)  # a copy: a view at an odd offset cannot be re-typed
        at += n
        if what in (ENTRIES, KEYS):
            mirror = hand.states.get(L)
            if mirror is None or (start == 0 and L not in fresh):  # a new sequence: a new mirror (once a message)
                mirror = hand.states[L] = V41LayerState(*cache.codes)
                fresh.add(L)
            state = mirror.entries if what == ENTRIES else mirror.keys
            if state.store is None:
                state.ready(fmts[0] if what == ENTRIES else fmts[1], cache.batch, 1, 1, 1, False, cache.device)
            if shape[1]:
                state.store.append(x)
                state.count += shape[1]
        elif what == CHOSEN:
            hand.chosen[L] = (x, None)
        elif what == CHOSEN + "_valid":
            hand.chosen[L] = (hand.chosen[L][0], x)
        else:
            hand.candidates = x
