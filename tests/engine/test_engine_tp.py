"""Tensor parallel: tp = 2 under torchrun (gloo) gives the tp = 1 logits; a world size that differs from the
converted tp degree is a clear error."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from helpers import shard_job
from kconvert.convert.shard.job import shard
from helpers import ROOT


def test_tp2_under_torchrun_matches_tp1(checkpoint, tmp_path):
    src = checkpoint("tiny-k25-dsv32")
    tp1, tp2 = tmp_path / "tp1", tmp_path / "tp2"
    shard(shard_job(src, tp1, tp=1))
    shard(shard_job(src, tp2, tp=2))
    seed = int.from_bytes(os.urandom(4), "little")
    out = tmp_path / "tp2.pt"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m",
                           "engine.runtime.tp_check", str(tp2), "--seed", str(seed), "--length", "40", "--decode", "3",
                           "--save", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from engine.runtime.tp_check import run

    ref = run(tp1, seed, 40, 3)
    got = torch.load(out)
    assert got.shape == ref.shape == (1, 43, 1024)
    err = (got - ref).abs().max().item()
    assert err <= 1e-4 * ref.abs().max().item(), f"tp2 vs tp1: max |Δ| {err:.3g} (seed {seed})"

    # world size 1 on a tp = 2 conversion: one clear line, exit 2
    bad = subprocess.run([sys.executable, "-m", "engine.runtime.tp_check", str(tp2), "--save", str(tmp_path / "x.pt")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "tp 2" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
