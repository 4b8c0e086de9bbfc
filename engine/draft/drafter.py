"""Greedy drafts from a model's draft heads, kept in step with its target (engine/runtime/speculative.py).

The drafter holds the first draft head and its own cache. Its positions follow the target's: after
`extend(hidden, tokens)` with the target's last-stage residuals at positions p.. and the token after each, the
head has read every position up to the target's length, and its output at the last one is the first draft.
`draft(k)` proposes k tokens: the first from that output, each next one by running the same head one position
further on its own carry and the draft before (chained re-use of one head: the released DeepSeek-V3 / V3.2 /
K2 / V4 checkpoints have one MTP layer, `num_nextn_predict_layers` 1; with more, the first is chained and the
others are loaded but not used). The chained positions are dropped again at once; verified tokens are read
by `extend` with the target's own hidden states. `sync(n)` goes back to the target's length n (a new chat turn
may re-render the last token) within the last `extend`.

It runs on the last pipeline stage (where the target's residual and the heads are); every tp rank of that
stage runs it (vocab-parallel embeddings and head, tp-split block), and the drafts go to every rank from the
last stage. A drafter of another shape (DSpark's block drafter, engine/draft/dspark.py) offers the same calls; it
may read the residual after other target layers (`tap_layers`) instead of the last stage's.""" 

from __future__ import annotations

import torch

from engine.cache.latent import KVOptions
from engine.draft.context import Context
from kconvert.errors import EngineError, UsageError


def new_drafter(model, k: int | None = None):
    """`model`'s drafter (engine/model.Model) on the last stage, None on the others; a UsageError (on every rank)
    when its conversion holds no draft heads."""
    if not model.draft_layers:
        raise UsageError("this conversion holds no draft heads (its source has none, or it was converted with "
                         "--no-draft-heads): --speculative needs them")
    from engine.draft.registry import DRAFTERS

    cls = DRAFTERS.get(model.cfg.draft_kind, Drafter)
    model.tap_layers = cls.tap_layers(model)  # every rank: the last stage collects them in its forwards
    return cls(model, k) if model.par.last else None


class Drafter:
    @staticmethod
    def tap_layers(model) -> list[int]:
        return []  # an MTP head reads the target's last-stage residual itself

    def __init__(self, model, k: int | None = None):
        self.model = model
        self.layers = sorted(model.draft_layers)
        self.head = model.draft_heads[str(self.layers[0])]
        self.k = len(self.layers) if k is None else k
        self.ctx = Context(model)
        self.cache = None
        self.length = 0
        self.logits = self.carry = None  # the head's output at the last position read
        self.tail: torch.Tensor | None = None  # the target's residual at the last position read

    def start(self, max_len: int) -> None:
        """A new sequence of up to max_len tokens (its cache: the model's KV format, no budget of its own)."""
        self.cache = self.head.new_cache(self.model, 1, max_len + self.k + 1, KVOptions(self.model.kv.kv_dtype))
        self.length, self.logits, self.carry, self.tail = 0, None, None, None

    @torch.inference_mode()
    def extend(self, x: torch.Tensor, tokens: list[int]) -> None:
        """Read positions length..length+S-1: x [1,S,...] the target's last-stage residuals there, tokens the S
        tokens after them."""
        self.cache.mark()  # resume() may go back into this read
        ids = torch.tensor([tokens], device=self.model.device)
        normed, carry = self.head(self.ctx, self.head.from_target(self.model, x), ids, self.length, self.cache)
        self.length += ids.shape[1]
        self.logits = self.ctx.logits(normed[:, -1:], self.head.own("head"))[0, -1]
        self.carry, self.tail = carry[:, -1:], x[:, -1:]

    @torch.inference_mode()
    def score(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [S, V] of the head at every position of a sequence read from its start (a fresh cache): x
        [1,S,...] the target's residuals, tokens [1,S] the token after each (verify's next-token check)."""
        self.start(x.shape[1])
        normed, _ = self.head(self.ctx, self.head.from_target(self.model, x), tokens.to(self.model.device), 0,
                              self.cache)
        return self.ctx.logits(normed, self.head.own("head"))[0]

    def resume(self, n: int) -> torch.Tensor:
        """A new turn continues the target at its length n (this drafter's length): forget the last position
        (the token after it may differ now) and give back the target's residual there, to read it again with
        the next extend."""
        if n != self.length or self.tail is None:
            raise EngineError(f"the drafter holds {self.length} positions; the target continues at {n}")
        tail = self.tail
        self.cache.rollback(n - 1)
        self.length, self.logits, self.carry, self.tail = n - 1, None, None, None
        return tail

    @torch.inference_mode()
    def draft(self, k: int) -> list[int]:
        """k greedy drafts after the last position read (chained re-use of the head past the first)."""
        if k <= 0:
            return []
        tok = int(self.logits.argmax())
        drafts, carry = [tok], self.carry
        if k > 1:
            self.cache.mark()
            pos = self.length
            for _ in range(k - 1):
                ids = torch.tensor([[tok]], device=self.model.device)
                normed, carry = self.head(self.ctx, carry, ids, pos, self.cache)
                tok = int(self.ctx.logits(normed, self.head.own("head"))[0, -1].argmax())
                drafts.append(tok)
                pos += 1
            self.cache.rollback(self.length)
        return drafts
