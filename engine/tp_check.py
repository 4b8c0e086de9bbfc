"""Run one forward pass (prefill + a few decode steps) under torchrun and save rank 0's logits.

    torchrun --nproc-per-node 2 -m engine.tp_check OUT --seed 7 --length 40 --save logits.pt
"""

from __future__ import annotations

import argparse
import sys

import torch

from engine.model import Model
from kconvert.distributed import Group
from kconvert.errors import KConvertError


def run(path, seed: int, length: int, decode: int, device: str = "cpu") -> torch.Tensor:
    par = Group.from_env(device)
    model = Model.from_converted(path, device=device, dtype=torch.float32, par=par)
    ids = torch.randint(0, min(768, model.cfg.vocab_size), (1, length + decode), generator=torch.Generator().manual_seed(seed))
    cache = model.new_cache(1, length + decode)
    out = [model.forward(ids[:, :length], cache)]
    for t in range(length, length + decode):
        out.append(model.forward(ids[:, t:t + 1], cache))
    return torch.cat(out, dim=1).cpu()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("path")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--length", type=int, default=40)
    ap.add_argument("--decode", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--save", required=True)
    a = ap.parse_args(argv)
    try:
        logits = run(a.path, a.seed, a.length, a.decode, a.device)
    except KConvertError as e:
        print(f"error: {e.one_line()}", file=sys.stderr)
        return 2
    import os

    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(logits, a.save)
    return 0


if __name__ == "__main__":
    sys.exit(main())
