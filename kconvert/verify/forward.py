"""The engine's side of one reference prompt: its inputs, and the hidden states after every layer
(the positions transformers' output_hidden_states reports). Shared by verify runs and attribution."""

from __future__ import annotations

import torch

from engine.linear import rms_norm
from kconvert.verify.prompts import prompt_patches


def engine_inputs(prompt: dict, tokens: torch.Tensor, model, config: dict):
    """(ids [1, T], image features or None) for one reference prompt."""
    ids = tokens[None].to(torch.int64)
    if not prompt.get("image"):
        return ids, None
    patches, grid, _ = prompt_patches(prompt, config)
    return ids, model.vision(patches.to(model.dtype), [grid])


def hidden_states(model, ids: torch.Tensor, image_embeds) -> list[torch.Tensor]:
    """[embeddings, after layer 0, ..., after layer N-2, final-norm(after layer N-1)]: the same
    positions transformers' output_hidden_states reports."""
    cache = model.new_cache(1, ids.shape[1])
    x = model.embed_tokens(ids)
    if image_embeds is not None:
        x = model.scatter_images(ids, x, image_embeds)
    cos, sin = model.rotary(torch.arange(ids.shape[1]), model.dtype)
    out = [x[0].float()]
    for i, layer in enumerate(model.layers):
        x = layer.forward(x, 0, cache.layers[i], cos[None], sin[None], model.par)
        out.append(x[0].float())
    out[-1] = rms_norm(x, model.norm, model.cfg.rms_norm_eps)[0].float()
    return out
