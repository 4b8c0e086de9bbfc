"""Run one forward pass (prefill + a few decode steps) under torchrun and save rank 0's logits.

    torchrun --nproc-per-node 2 -m engine.runtime.tp_check OUT --seed 7 --length 40 --save logits.pt
    torchrun --nproc-per-node 4 -m engine.runtime.tp_check OUT_TP2_PP2 --save logits.pt       # tp 2 x pp 2
    torchrun --nproc-per-node 2 -m engine.runtime.tp_check OUT_TP1 --stages 0,1-2 --save x.pt  # a tp-1 conversion as 2 stages

--chunk sets the prefill micro-batch (tokens) under pp > 1 (0: the whole prompt at once). Several, as in
--chunk 16,0, run the same ids once per value on the one loaded model (a fresh cache each) and save
{chunk: logits} instead of one tensor.
"""

from __future__ import annotations

import argparse
import sys

import torch

from engine.model import Model
from kconvert.distributed import Group
from kconvert.errors import KConvertError


def parse_stages(text: str | None) -> list[list[int]] | None:
    """"0,1-2" -> [[0], [1, 2]] (the layers of each stage)."""
    if not text:
        return None
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.append(list(range(int(lo), int(hi or lo) + 1)))
    return out


def run(path, seed: int, length: int, decode: int, device: str = "cpu", stages=None,
        chunk: int | None = None) -> torch.Tensor:
    return run_chunks(path, seed, length, decode, device, stages, [chunk])[chunk]


def run_chunks(path, seed: int, length: int, decode: int, device: str = "cpu", stages=None,
               chunks=(None,)) -> dict:
    """{chunk: logits} of one prefill + decode per prefill micro-batch size (None: the model's default)."""
    par = Group.from_env(device)
    model = Model.from_converted(path, device=device, dtype=torch.float32, par=par, stages=stages)
    default = model.prefill_chunk
    ids = torch.randint(0, min(768, model.cfg.vocab_size), (1, length + decode), generator=torch.Generator().manual_seed(seed))
    got = {}
    for chunk in chunks:
        model.prefill_chunk = default if chunk is None else chunk
        cache = model.new_cache(1, length + decode)
        out = [model.forward(ids[:, :length], cache)]
        for t in range(length, length + decode):
            out.append(model.forward(ids[:, t:t + 1], cache))
        got[chunk] = torch.cat(out, dim=1).cpu()
    return got


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("path")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--length", type=int, default=40)
    ap.add_argument("--decode", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--stages", help="run a pp = 1 conversion as these stages of layers, e.g. 0,1-2")
    ap.add_argument("--chunk", type=lambda s: [int(c) for c in s.split(",")],
                    help="prefill micro-batch in tokens under pp > 1 (0: no split); several, comma-separated, "
                         "run in turn on one loaded model and save {chunk: logits}")
    ap.add_argument("--save", required=True)
    a = ap.parse_args(argv)
    try:
        chunks = a.chunk or [None]
        got = run_chunks(a.path, a.seed, a.length, a.decode, a.device, parse_stages(a.stages), chunks)
    except KConvertError as e:
        print(f"error: {e.one_line()}", file=sys.stderr)
        return 2
    import os

    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(got if len(chunks) > 1 else got[chunks[0]], a.save)
    Group.from_env(a.device).close()  # leave together: a rank that exits while a peer still talks to it aborts it
    return 0


if __name__ == "__main__":
    sys.exit(main())
