"""The engine's side of one reference prompt: its inputs, and the hidden states after every layer
(the positions transformers' output_hidden_states reports). Shared by verify runs and attribution.

Under pipeline parallelism (tp x pp) each stage computes the states of its own layers; `hidden_states`
brings every stage's states, and the last stage's logits, to one writer rank."""

from __future__ import annotations

import torch

from kconvert.verify.prompts import prompt_patches


def engine_inputs(prompt: dict, tokens: torch.Tensor, model, config: dict):
    """(ids [1, T], image features or None) for one reference prompt. The features are computed where the
    vision tower is (the first pipeline stage); the other stages get None and do not need them."""
    ids = tokens[None].to(torch.int64)
    if not prompt.get("image") or model.vision is None:
        return ids, None
    patches, grid, _ = prompt_patches(prompt, config)
    return ids, model.vision(patches.to(model.dtype), [grid])


def stage_states(model, ids: torch.Tensor, image_embeds, caches: list | None = None) -> dict[int, torch.Tensor]:
    """This stage's residuals by reported position k (k = 0: embeddings; k = L + 1: after layer L; the last
    position is the final norm of the last layer's output), whole (a layer's input, for attribution; verify
    compares the stack's `reported` part of them). A stage's entries include the input of each
    of its layers (the first one received from the previous stage). `caches`: gets the cache the layers ran
    with (attribution reruns one layer with what the others left in it). Every rank of the run calls this."""
    par = model.par
    T = ids.shape[1]
    cache = model.new_cache(1, T)
    if caches is not None:
        caches.append(cache)
    cos, sin = model.rotary(torch.arange(T), model.dtype)
    if par.first:
        x = model.stage_input(ids.to(model.device), image_embeds)
    else:
        x = par.recv_prev((1, T, *model.stack.residual_shape_at(model.stage_layers[0])), model.dtype, model.device)
        if hasattr(model.stack, "receive_crossing"):  # state earlier stages made for this one's layers (V4.1)
            model.stack.receive_crossing(model, cache, 0, T)
    out = {model.stage_layers[0]: x[0].float()}
    ids = ids.to(model.device)
    for L in model.stage_layers:  # ids: for layers that route by token (DeepSeek-V4's hash layers)
        x = model.layer(L).forward(x, 0, cache.layers[model.slot[L]], cos[None], sin[None], par, ids=ids)
        out[L + 1] = x[0].float()
    if par.last:
        out[model.cfg.num_layers] = model.final_norm(x)[0].float()
    else:
        par.send_next(x)
        extra = model.stack.crossing(model, cache, 0, T) if hasattr(model.stack, "crossing") else None
        if extra is not None:
            par.send_next(extra)
    return out


def hidden_states(model, ids: torch.Tensor, image_embeds, writer: int = 0):
    """(states, logits [1,T,V]) on rank `writer`, (None, None) elsewhere. states: [embeddings, after layer 0,
    ..., after layer N-2, final-norm(after layer N-1)], the positions transformers' output_hidden_states
    reports. Every rank of the run calls this."""
    par = model.par
    mine = stage_states(model, ids, image_embeds)  # whole residuals: what is compared is the stack's `reported` part
    final = model.cfg.num_layers
    mine = {k: v if k == final else model.stack.reported(v) for k, v in mine.items()}
    logits = None
    if par.last:  # one pass gives both: the logits are the head of the last (final-norm) state
        logits = par.all_gather_last(model.head(mine[model.cfg.num_layers][None].to(model.dtype))).float()
    if par.pp == 1:
        return (list(mine.values()), logits) if par.rank == writer else (None, None)
    T, V = ids.shape[1], model.cfg.vocab_size
    residual = tuple(model.stack.reported(torch.empty(1, *model.stack.residual_shape)).shape[1:])  # per token
    if par.rank == writer:
        got = dict(mine)
        for s, layers in enumerate(model.stages):  # each stage's tp rank 0 sends what it computed, in order
            src = par.rank_of(s, 0)
            if src != writer:
                for L in layers:  # the last one: the final norm's output, one hidden wide (not the residual)
                    shape = (T, model.cfg.hidden_size) if L + 1 == model.cfg.num_layers else (T, *residual)
                    got[L + 1] = par.recv(shape, torch.float32, model.device, src)
        if logits is None:
            logits = par.recv((1, T, V), torch.float32, model.device, par.last_rank)
        return [got[k] for k in range(model.cfg.num_layers + 1)], logits
    if par.tp_rank == 0:
        for L in model.stage_layers:
            par.send(mine[L + 1], writer)
        if par.last:
            par.send(logits, writer)
    return None, None
