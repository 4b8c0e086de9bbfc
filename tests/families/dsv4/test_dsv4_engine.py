"""DeepSeek-V4 conversions through the engine: a tiny-dsv4 conversion (released names on disk, renamed onto
the engine's module tree by the manifest) gives transformers' logits; the release's FP4 experts kept as
FP4 give exactly the logits of their dequantized twin; tp 2 and tp 2 x pp 2 give tp 1's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from helpers import ROOT
from helpers import shard_job
from kconvert.convert.shard.job import shard
from dsv4_reference import earliest_ties


@pytest.fixture(scope="module")
def conversions(checkpoint, tmp_path_factory):
    d = tmp_path_factory.mktemp("dsv4conv")
    made = {}

    def get(preset: str, quant: str = "none", tp: int = 1, pp: int = 1):
        key = (preset, quant, tp, pp)
        if key not in made:
            out = d / f"{preset}-{quant}-tp{tp}-pp{pp}"
            shard(shard_job(checkpoint(preset), out, tp=tp, pp=pp, quant=quant))
            made[key] = out
        return made[key]

    return get


def _ids(vocab: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


def test_converted_tiny_dsv4_matches_transformers(checkpoint, conversions):
    """Every branch (sliding, CSA with its indexer, HCA, hash and top-k routing, mHC) on a prompt past the
    compress rates and the indexer's top-k; float32 both sides, exact indexer ties to the earliest entry."""
    from transformers import DeepseekV4ForCausalLM

    from engine.model import Model

    seed = int.from_bytes(os.urandom(4), "little")
    ref = DeepseekV4ForCausalLM.from_pretrained(checkpoint("tiny-dsv4"), dtype=torch.float32).eval()
    model = Model.from_converted(conversions("tiny-dsv4"), dtype=torch.float32)
    ids = _ids(model.cfg.vocab_size, 64, seed)
    with torch.no_grad(), earliest_ties():
        want = ref(ids, use_cache=False).logits.float()
    got = model.forward(ids)
    kld = torch.nn.functional.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True,
                                     reduction="none").sum(-1).mean().item()
    err = (got - want).abs().max().item()
    assert kld < 1e-5 and err <= 1e-4 * want.abs().max().item(), f"KLD {kld:.2e}, max |Δ| {err:.2e} (seed {seed})"


def test_fp4_experts_kept_give_their_dequantized_twin_exactly(conversions):
    """tiny-dsv4-flash with `--quant fp4` keeps the release's FP4 experts (e2m1 codes + e8m0 scales, copied bit
    for bit) and makes its FP8 linears bf16; with `--quant none` every weight is dequantized to bf16. e2m1
    times a power of two is exact in bf16, so the two models compute the same logits."""
    from engine.layers.linear import BY_TRANSFORM
    from engine.model import Model

    kept, twin = (Model.from_converted(conversions("tiny-dsv4-flash", q), dtype=torch.float32) for q in ("fp4", "none"))
    expert = next(m for n, m in kept.named_modules() if n.endswith("mlp.experts.0.gate_proj"))
    assert type(expert) is BY_TRANSFORM["fp4_copy"]  # stays FP4 in memory
    ids = _ids(kept.cfg.vocab_size, 48, int.from_bytes(os.urandom(4), "little"))
    assert torch.equal(kept.forward(ids), twin.forward(ids))


@pytest.mark.parametrize("tp,pp", [(2, 1), (2, 2)])
def test_tp_and_pp_under_torchrun_match_tp1(conversions, tmp_path, tp, pp):
    from engine.runtime.tp_check import run

    seed = int.from_bytes(os.urandom(4), "little")
    out = tmp_path / "got.pt"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(tp * pp), "-m",
                           "engine.runtime.tp_check", str(conversions("tiny-dsv4", tp=tp, pp=pp)), "--seed", str(seed),
                           "--length", "40", "--decode", "3", "--save", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref = run(conversions("tiny-dsv4"), seed, 40, 3)
    got = torch.load(out)  # our own tp_check output, not a user's file
    err = (got - ref).abs().max().item()
    assert got.shape == ref.shape and err <= 1e-4 * ref.abs().max().item(), f"max |Δ| {err:.3g} (seed {seed})"
