"""Engine logits against transformers (the reference), decode-cache correctness, quantized conversions.

fp32 compute on both sides; fresh random prompts every run (the seed is printed on failure)."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

from engine.models.deepseek_v3.dsa_indexer import top_keys
from engine.layers.linear import BY_TRANSFORM

TOL = 1e-4  # max |Δ| relative to the reference's max |logit|


def fresh_seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


# ---- The transformers reference, with one adjustment: exact ties in the DSA indexer.
#
# The tiny fixtures have 4 indexer heads, so many keys score exactly 0 (ReLU of every head negative) and the
# top-k boundary often falls inside such a tie. torch.topk picks among tied entries in a way that depends
# on the row length and batch shape, so transformers' own choice differs between a prefill and a cached
# decode of the same sequence. The engine breaks ties by position (earliest first, `engine.models.deepseek_v3.dsa_indexer.top_keys`);
# here the reference indexer's final top-k uses the same rule, nothing else changes.

@contextlib.contextmanager
def indexer_ties_by_position():
    """Yields the (batch, query) positions whose top-k boundary is a *near* tie: the k-th and the next key's
    scores within fp32 rounding (1e-5 relative), where the reference and the engine, summing in different orders,
    may each rightly pick either key (seen: scores 1.076507 and 1.076506). `_compare` leaves those positions,
    and the later ones of that prompt (whose attention reads them), out."""
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as mod

    forward, tensor_topk = mod.DeepseekV32Indexer.forward, torch.Tensor.topk
    near: set[tuple[int, int]] = set()

    def topk(self, k, dim=-1, largest=True, sorted=True):
        assert largest and dim in (-1, self.dim() - 1)
        if self.shape[-1] > k:
            v = tensor_topk(self, k + 1, dim=-1).values
            a, b = v[..., k - 1], v[..., k]
            hit = (a - b <= 1e-5 * a.abs().clamp_min(1)) & ~((a == 0) & (b == 0))  # ReLU's exact zeros: by position
            near.update((i[0], i[1]) if len(i) > 1 else (0, i[0]) for i in hit.nonzero().tolist())
        idx = top_keys(self, k)
        return torch.return_types.topk((self.gather(-1, idx), idx))

    def patched(self, *args, **kwargs):
        torch.Tensor.topk = topk
        try:
            return forward(self, *args, **kwargs)
        finally:
            torch.Tensor.topk = tensor_topk

    mod.DeepseekV32Indexer.forward = patched
    try:
        yield near
    finally:
        mod.DeepseekV32Indexer.forward = forward


@pytest.fixture(scope="module")
def converted(conversion):
    """converted(preset, tp, quant) -> Path of a conversion (the session's, conftest.conversion)."""
    return lambda preset, tp=1, quant="none": conversion(preset, tp=tp, quant=quant)


@pytest.fixture(scope="module")
def reference(checkpoint):
    models = {}

    def get(preset: str):
        if preset not in models:
            if preset == "tiny-dsv32":
                from transformers import DeepseekV32ForCausalLM as cls
            else:
                from transformers.models.kimi_k25 import Kimi_K25ForConditionalGeneration as cls
            models[preset] = cls.from_pretrained(str(checkpoint(preset)), dtype=torch.float32).eval()
        return models[preset]

    return get


@pytest.fixture(scope="module")
def engine(converted):
    from engine.model import Model

    models = {}

    def get(preset: str, tp: int = 1, quant: str = "none"):
        key = (preset, tp, quant)
        if key not in models:
            models[key] = Model.from_converted(converted(preset, tp, quant), dtype=torch.float32)
        return models[key]

    return get


def _kept(shape, near) -> torch.Tensor:
    keep = torch.ones(shape, dtype=torch.bool)
    for b, q in near:  # a near tie in the indexer (indexer_ties_by_position): from there on either choice is right
        keep[b, q:] = False
    return keep


def _enough(ref_logits, near) -> bool:
    """Whether the near ties leave at least half the positions to compare; else the test draws another prompt (an
    early tie on one random prompt in a few dozen: the seed is fresh every run)."""
    return bool(_kept(ref_logits.shape[:2], near).float().mean() >= 0.5)


ATTEMPTS = 5  # fresh prompts a test draws before an early near tie on each counts as a failure


def _reference_run(run):
    """run(generator) -> (inputs, the reference's logits), run with the indexer's near ties recorded; drawn again
    from a fresh seed (up to ATTEMPTS) while they leave less than half the positions to compare.
    -> (seed, inputs, logits, near ties)."""
    for _ in range(ATTEMPTS):
        seed = fresh_seed()
        with torch.no_grad(), indexer_ties_by_position() as near:
            inputs, ref = run(torch.Generator().manual_seed(seed))
        if _enough(ref, near):
            break
    return seed, inputs, ref, near


def _compare(ref_logits, eng_logits, seed, what, near=()):
    keep = _kept(ref_logits.shape[:2], near)
    assert keep.float().mean() >= 0.5, f"{what}: near ties at {sorted(near)} leave too little to compare (seed {seed})"
    scale = ref_logits.abs().max().item()
    err = (ref_logits - eng_logits)[keep].abs().max().item()
    assert err <= TOL * scale, f"{what}: max |Δ| {err:.3g} > {TOL} x {scale:.3g} (seed {seed}, near ties {sorted(near)})"


@pytest.mark.parametrize("preset", ["tiny-k25-dsv32", "tiny-dsv32"])
@pytest.mark.parametrize("length", [8, 60])  # index_topk is 16: below and well above it
def test_text_logits_match_transformers(preset, length, reference, engine):
    def run(g):
        ids = torch.randint(0, 768, (2, length), generator=g)  # batch of 2 prompts
        return ids, reference(preset)(input_ids=ids).logits

    seed, ids, ref, near = _reference_run(run)
    _compare(ref, engine(preset).forward(ids), seed, f"{preset} length {length}", near)


def test_image_prompt_logits_match_transformers(reference, engine):
    from PIL import Image

    from engine.inputs.image import preprocess

    model = engine("tiny-k25-dsv32")
    vc = model.mc.vision

    def run(g):
        pixels = (torch.rand(75, 110, 3, generator=g) * 255).to(torch.uint8).numpy()
        patches, grid = preprocess(Image.fromarray(pixels))  # 75x110 -> padded 84x112 -> 6x8 patches -> 12 tokens
        assert grid == (6, 8)
        n = model.tokens_per_image(grid)
        ids = torch.cat([torch.randint(0, 768, (5,), generator=g), torch.tensor([786]),
                         torch.full((n,), vc.image_token_id), torch.tensor([788]),
                         torch.randint(0, 768, (40,), generator=g)])[None]
        ref = reference("tiny-k25-dsv32")(input_ids=ids, pixel_values=patches,
                                          image_grid_thw=torch.tensor([[1, *grid]])).logits
        return (ids, patches, grid), ref

    seed, (ids, patches, grid), ref, near = _reference_run(run)
    out = model.forward(ids, image_embeds=model.vision(patches, [grid]))
    _compare(ref, out, seed, "text+image", near)


def test_decode_steps_equal_full_forward(engine):
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    model = engine("tiny-k25-dsv32")
    ids = torch.randint(0, 768, (1, 40), generator=g)
    cache = model.new_cache(1, 64)
    model.forward(ids[:, :6], cache)
    for t in range(6, 40):  # crosses index_topk (16): the sparse selection kicks in mid-decode
        step = model.forward(ids[:, t:t + 1], cache)
        full = model.forward(ids[:, :t + 1])[:, -1:]
        _compare(full, step, seed, f"decode step {t}")
    assert cache.length == 40


@pytest.mark.parametrize("quant", ["fp8", "int8", "fp4"])
def test_quantized_conversion_close_to_bf16(quant, engine):
    seed = fresh_seed()
    ids = torch.randint(0, 768, (1, 48), generator=torch.Generator().manual_seed(seed))
    base = engine("tiny-k25-dsv32").forward(ids)
    q = engine("tiny-k25-dsv32", 1, quant)
    if quant == "fp4":  # routed experts only, as DeepSeek-V4 stores them
        expert = q.layer(1).mlp.experts["0"]
        kinds = {type(w) for w in (expert.gate_proj, expert.down_proj)}
    else:
        attn = q.layer(1).self_attn
        kinds = {type(w) for w in (attn.q_b_proj, attn.o_proj)}
    assert kinds == {BY_TRANSFORM[quant]}, kinds  # weights stay quantized in memory
    out = q.forward(ids)
    kld = torch.nn.functional.kl_div(out.log_softmax(-1), base.log_softmax(-1), log_target=True,
                                     reduction="none").sum(-1).mean().item()
    same_top1 = (out.argmax(-1) == base.argmax(-1)).float().mean().item()
    assert kld < 0.15 and same_top1 > 0.7, f"{quant}: KLD {kld:.3f}, top-1 {same_top1:.2f} (seed {seed})"


def test_indexer_ties_go_to_earliest_keys_whatever_the_row_length():
    row = torch.tensor([0.0, 2.0, 0.0, 0.0, 1.0, 0.0])
    assert sorted(top_keys(row, 4).tolist()) == [0, 1, 2, 4]
    longer = torch.cat([row, torch.full((50,), float("-inf"))])[None, None]
    assert sorted(top_keys(longer, 4).flatten().tolist()) == [0, 1, 2, 4]
    assert sorted(top_keys(torch.zeros(1000), 3).tolist()) == [0, 1, 2]
