"""The DSpark block drafter (draft kinds "dspark": DeepSeek-V4.1, and "v4_dspark": DeepSeek-V4-0731's layout): it
runs a family's stages (engine/models/deepseek_v41/dspark.py, engine/models/deepseek_v4/dspark.py) a block at a time.

What it is (FACTS.md "DeepSeek-V4.1 and draft heads"; the same algorithm as mlx-vlm 0.7.10's deepseek_v4_dspark
drafter for V4's layout, the only implementation on this machine): the target's residual after the layers of
`dspark_target_layer_ids`, each averaged over its hc streams and concatenated, goes through the first stage's
`main_proj` and `main_norm`: the context. Each stage is a window-only block whose attention reads that context's
keys (kept for the last `sliding_window` - 1 positions plus those read since the last block) and the block's own: a
block is the anchor (the last verified token) and `dspark_block_size` - 1 noise tokens (`dspark_noise_token_id`), at
the positions after the context, attending to all of it and to each other (no causal mask), with a sink per head.
The last stage leaves through its own merge and `norm`, then the target's head: the block's base logits. Draft j is
the argmax of base logits j plus the Markov bias of draft j-1 (the anchor for j = 0). The confidence head is loaded;
greedy drafting proposes the whole block and the target decides, so it is not consulted.

The drafter reads the target's context where engine/runtime/speculative.py hands the MTP drafter its residual:
`Model.tap_layers` makes the forward collect the taps instead, each stage passing those of its layers on with the
residual, so the last stage (the drafter's) has them all. A stage kind offers: first / last / window, context
(first), context_keys, forward, leave and markov (last)."""

from __future__ import annotations

import torch

from engine.draft.context import Context
from kconvert.errors import CheckpointError, EngineError, UsageError

class DSparkDrafter:
    """engine/draft/drafter.Drafter's calls (start, extend, score, resume, draft) for a DSpark drafter."""

    def __init__(self, model, k: int | None = None):
        self.model, self.ctx = model, Context(model)
        self.stages = [model.draft_heads[str(L)] for L in sorted(model.draft_layers)]
        if not (self.stages[0].first and self.stages[-1].last):
            raise CheckpointError(f"the DSpark drafter's stages {sorted(model.draft_layers)} are not all of "
                                  f"{model.cfg.key_prefix}num_nextn_predict_layers", file=model.cfg.config_file)
        self.block, self.noise = self.block_settings(model.cfg)
        self.k = self.block if k is None else k
        if not 1 <= self.k <= self.block:
            raise UsageError(f"a DSpark drafter proposes 1..{self.block} tokens a round (one block), not {self.k}")
        self.window = self.stages[0].window
        self.keys: list[torch.Tensor] = []
        self.length, self.seen, self.anchor, self.tail = 0, 0, None, None

    @staticmethod
    def block_settings(cfg) -> tuple[int, int]:
        """(dspark_block_size, dspark_noise_token_id) of a config with a drafter: bind refuses a config that has a
        drafter without them, or with them outside their bounds (manifests/limits.toml), before any work."""
        c = cfg.reads()
        block, noise = c.get("dspark_block_size"), c.get("dspark_noise_token_id", 0)  # absent noise: 0, as mlx-vlm
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise CheckpointError(f"{c.prefix}dspark_block_size = {block!r:.40}: a DSpark drafter needs a block of at "
                                  "least 1 token", file=c.file)
        if isinstance(noise, bool) or not isinstance(noise, int) or not 0 <= noise < cfg.vocab_size:
            raise CheckpointError(f"{c.prefix}dspark_noise_token_id = {noise!r:.40}: not a token of the vocabulary "
                                  f"({cfg.vocab_size})", file=c.file)
        return block, noise

    @staticmethod
    def tap_layers(model) -> list[int]:
        """The target layers whose residual the drafter reads (their taps travel with the residual to the last
        pipeline stage: engine/pipeline.py)."""
        taps = [int(L) for L in model.cfg.section.get("dspark_target_layer_ids") or []]
        if not taps:  # (each names a decoder layer: the manifest's limits checked that when the config was bound)
            raise CheckpointError(f"{model.cfg.key_prefix}dspark_target_layer_ids is empty: the DSpark drafter reads no "
                                  "target layer", file=model.cfg.config_file)
        return taps

    def start(self, max_len: int) -> None:
        self.keys = [None] * len(self.stages)
        self.length, self.seen, self.anchor, self.tail = 0, 0, None, None

    @torch.inference_mode()
    def extend(self, x: torch.Tensor, tokens: list[int]) -> None:
        """Read positions length..length+S-1: x [1,S,len(targets) * hidden] the taps there, tokens the S tokens
        after them (the last one is the next block's anchor)."""
        ctx = self.stages[0].context(x.to(self.model.device))
        for i, stage in enumerate(self.stages):
            new = stage.context_keys(ctx, self.length)
            self.keys[i] = new if self.keys[i] is None else torch.cat([self.keys[i], new], 1)
        self.length += x.shape[1]
        self.anchor, self.tail = int(tokens[-1]), x[:, -1:]

    def _blocks(self, anchors: torch.Tensor, keys: list, starts: torch.Tensor, visible=None) -> torch.Tensor:
        """Base logits [B, block, vocab] of B blocks (anchors [B], row b's at positions starts[b]..)."""
        m, last = self.model, self.stages[-1]
        ids = torch.cat([anchors[:, None], torch.full((len(anchors), self.block - 1), self.noise)], 1)
        h = m.stack.enter(self.ctx.embed(ids.to(m.device), None))
        for stage, k in zip(self.stages, keys):
            h = stage(h, k, starts.to(m.device), m.par, visible)
        return self.ctx.logits(last.leave(h), None)

    def _base_logits(self) -> torch.Tensor:
        """The next block's base logits [block, vocab] after the positions read; the keys read since the last block
        are seen from now on (the context keeps window - 1 of them, plus those read next)."""
        keep = max(0, self.seen - (self.window - 1))
        self.keys = [k[:, keep:] for k in self.keys]
        self.seen = self.keys[0].shape[1]
        return self._blocks(torch.tensor([self.anchor]), self.keys, torch.tensor([self.length]))[0]

    @torch.inference_mode()
    def draft(self, k: int) -> list[int]:
        """k (<= dspark_block_size) greedy drafts after the last position read: one block."""
        if k <= 0:
            return []
        if k > self.block:
            raise EngineError(f"a DSpark block holds {self.block} drafts, {k} were asked")
        base, last = self._base_logits(), self.stages[-1]
        prev, drafts = self.anchor, []
        for j in range(k):
            prev = int((base[j] + last.markov(torch.tensor([prev], device=base.device))[0]).argmax())
            drafts.append(prev)
        return drafts

    @torch.inference_mode()
    def score(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [S, V] the first draft is taken from at every position of a sequence read from its start: at
        position i the context is x[:, :i+1] (as decoding reads it one position a block: the last `window`
        positions seen) and the anchor tokens[0, i] (verify's next-token check: position i predicts token i + 2,
        as an MTP head's does). One batch of S blocks."""
        self.start(x.shape[1])
        S, dev = x.shape[1], self.model.device
        ctx = self.stages[0].context(x.to(dev))
        keys = [stage.context_keys(ctx, 0) for stage in self.stages]
        i, j = torch.arange(S, device=dev)[:, None], torch.arange(S, device=dev)[None]
        visible = (j <= i) & (j > i - self.window)
        anchors = tokens[0].to(dev)
        base = self._blocks(anchors, keys, torch.arange(1, S + 1), visible)[:, 0]
        return base + self.stages[-1].markov(anchors)

    def resume(self, n: int) -> torch.Tensor:
        """A new turn continues the target at its length n: forget the last position read and give back its taps."""
        if n != self.length or self.tail is None:
            raise EngineError(f"the drafter holds {self.length} positions; the target continues at {n}")
        tail = self.tail
        self.keys = [k[:, :-1] for k in self.keys]
        self.length, self.seen = n - 1, min(self.seen, self.keys[0].shape[1])
        self.anchor = self.tail = None
        return tail
