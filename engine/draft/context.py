"""What a draft head needs of its target model (engine/model.Model): the embeddings and head it shares
(vocab-parallel) and the process group. The chained MTP drafter (engine/draft/drafter.py) and DSpark's
(engine/draft/dspark.py) alike."""

from __future__ import annotations

import torch


class Context:
    """What a head needs of the target: its embeddings and head (vocab-parallel), rotary, process group."""

    def __init__(self, model):
        self.model, self.par = model, model.par

    def embed(self, ids: torch.Tensor, own: torch.Tensor | None) -> torch.Tensor:
        return self.model.embed_tokens(ids.to(self.model.device), own if own is not None else self.model.shared_embed)

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype):
        return self.model.rotary(positions, dtype)

    def logits(self, normed: torch.Tensor, own_head) -> torch.Tensor:
        head = own_head if own_head is not None else self.model.text.lm_head
        return self.par.all_gather_last(head(normed)).float()
