"""One forward pass through the pipeline stages (tp x pp; pp = 1 is the plain forward).

Every rank gets the same ids. The first stage embeds them; each stage runs its layers and sends the
hidden states to the same tp rank of the next stage; the last stage applies the final norm and head.
Prefill is split into micro-batches of `model.prefill_chunk` tokens so the stages overlap (stage s works
on chunk c + 1 while stage s + 1 works on chunk c): each chunk is appended to the paged cache before
the next, which is exact because attention is causal (chunk c + 1 attends to chunk c through the
cache, as a decode step does). Sends are asynchronous; a chunk's buffer is kept until its send is done.
"""

from __future__ import annotations

import torch

# Tokens per prefill micro-batch under pp > 1. Smaller chunks shrink the pipeline bubble but run smaller
# matrix products; bench/pp_bench.py measures the trade-off (docs/COMMANDS.md "Multi-node").
PREFILL_CHUNK = 256


def chunks(S: int, chunk: int, pp: int) -> list[tuple[int, int]]:
    """[lo, hi) token ranges of one forward: one range unless pp > 1 and the prompt is longer than a chunk."""
    if pp == 1 or chunk <= 0 or S <= chunk:
        return [(0, S)]
    n = -(-S // chunk)
    return [(S * i // n, S * (i + 1) // n) for i in range(n)]


def forward(model, ids: torch.Tensor, cache, image_embeds, last_only: bool, seqs, everywhere: bool, hidden=None):
    """`hidden`: a list the last stage appends what its drafter reads to, every position (its residual before the
    final norm, or the taps of model.tap_layers)."""
    par = model.par
    B, S = ids.shape
    first = model.stage_input(ids, image_embeds) if par.first else None
    outs, sending = [], []
    for lo, hi in chunks(S, model.prefill_chunk, par.pp):
        step = cache.begin(hi - lo, seqs)
        start = int(step.positions[0, 0])
        if par.first:
            x = first[:, lo:hi]
        else:
            x = par.recv_prev((B, hi - lo, *model.stack.residual_shape_at(model.stage_layers[0])), model.dtype,
                              model.device)
            if hasattr(model.stack, "receive_crossing"):  # state earlier stages' layers made for this one's (V4.1)
                model.stack.receive_crossing(model, cache, start, hi - lo)
        taps = model.taps_before(B, hi - lo) if hidden is not None and model.tap_layers else None
        x = model.run_layers(x, step.positions, cache, ids[:, lo:hi], taps)
        cache.commit(step)
        if not par.last:
            x = x.contiguous()
            sending.append((par.send_next(x, wait=False), x))
            extra = model.stack.crossing(model, cache, start, hi - lo) if hasattr(model.stack, "crossing") else None
            if extra is not None:
                sending.append((par.send_next(extra, wait=False), extra))
            if taps:  # the drafter's taps so far travel to the last stage with the residual
                sent = torch.stack([taps[L] for L in sorted(taps)], 2).contiguous()
                sending.append((par.send_next(sent, wait=False), sent))
        else:
            if hidden is not None:
                hidden.append(model.draft_input(x, taps))
            if not last_only or hi == S:
                outs.append(model.logits(x[:, -1:] if last_only else x))
    for work, _ in sending:
        work.wait()
    logits = torch.cat(outs, dim=1) if len(outs) > 1 else (outs[0] if outs else None)
    if par.pp == 1 or not everywhere:
        return logits
    if logits is None:
        logits = torch.empty(B, 1 if last_only else S, model.cfg.vocab_size, dtype=torch.float32, device=model.device)
    return par.broadcast(logits, par.last_rank)
