"""Speculative decoding (engine/runtime/speculative.py): the caches roll back exactly (the paged MLA + DSA cache of
DeepSeek-V3.2, DeepSeek-V4's rings and compressor states), and greedy speculative output equals plain greedy
output token for token, whatever the drafts (a drafter that knows the answer and errs on a pattern, the
conversion's own draft heads), at tp 1, tp 2 and pp 2, in one turn and across chat turns."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from engine.models.deepseek_v4.cache import V4LayerState
from engine.model import Model
from engine.runtime.generate import Sampling, generate
from engine.runtime.speculative import generate_speculative
from kconvert.errors import EngineError
from helpers import ROOT, assert_one_line_error, one_thread

PRESETS = ("tiny-dsv32-mtp", "tiny-dsv4")  # V3.2 (MLA + DSA, an MTP layer) and V4 (sliding / CSA / HCA, mtp.0)


@pytest.fixture(scope="module")
def models(conversion):
    with one_thread():
        yield {p: Model.from_converted(conversion(p, tp=1), dtype=torch.float32) for p in PRESETS}


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 700, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def continue_after(model, cache, tokens: list[int]) -> torch.Tensor:
    """Logits of `tokens` decoded one at a time after what `cache` holds."""
    return torch.cat([model.forward(torch.tensor([[t]]), cache) for t in tokens], 1)


def rolled_back(model, prefix, step, j, after):
    cache = model.new_cache(1, 64)
    model.forward(torch.tensor([prefix]), cache)
    cache.mark()
    model.forward(torch.tensor([step]), cache)  # a verify step of len(step) tokens
    cache.rollback(len(prefix) + j)
    return continue_after(model, cache, after)


@pytest.mark.parametrize("preset", PRESETS)
def test_rollback_leaves_what_the_kept_tokens_alone_leave(models, preset):
    """Mark, run a 6-token step, roll back to keep j of its tokens: decoding on gives what a cache that only ever
    saw those j tokens gives (the prefix ends mid-window: CSA rate 4, HCA 8, window 8 are all cut through)."""
    model = models[preset]
    prefix, step, after = ids(13, 1), ids(6, 2), ids(5, 3)
    with one_thread():
        for j in range(len(step) + 1):
            got = rolled_back(model, prefix, step, j, after)
            fresh = model.new_cache(1, 64)
            model.forward(torch.tensor([prefix]), fresh)
            if j:
                model.forward(torch.tensor([step[:j]]), fresh)
            want = continue_after(model, fresh, after)
            err = ((got - want).abs().max() / want.abs().max()).item()
            assert err < 1e-5, (j, err)


def test_a_v4_rollback_that_only_moves_the_length_is_caught(models, monkeypatch):
    """The check above can fail: rewinding a V4 layer's length without its ring and compressor state differs."""
    model = models["tiny-dsv4"]
    prefix, step, after = ids(13, 1), ids(6, 2), ids(5, 3)
    with one_thread():
        fresh = model.new_cache(1, 64)
        model.forward(torch.tensor([prefix + step[:2]]), fresh)
        want = continue_after(model, fresh, after)

        def length_only(self, n):
            self.length, self.marked = n, None

        monkeypatch.setattr(V4LayerState, "rewind", length_only)
        got = rolled_back(model, prefix, step, 2, after)
    assert ((got - want).abs().max() / want.abs().max()).item() > 1e-3


def test_a_v4_cache_goes_back_only_to_its_mark(models):
    model = models["tiny-dsv4"]
    cache = model.new_cache(1, 64)
    with one_thread():
        model.forward(torch.tensor([ids(5, 1)]), cache)
        with pytest.raises(EngineError, match="cannot go back"):
            cache.rollback(3)  # no mark
        cache.mark()
        model.forward(torch.tensor([ids(3, 2)]), cache)
        with pytest.raises(EngineError, match="cannot go back"):
            cache.rollback(4)  # before the mark


class Oracle:
    """A drafter that knows the greedy answer and makes a wrong draft on a fixed pattern (every `every`-th)."""

    def __init__(self, truth: list[int], k: int, every: int):
        self.truth, self.k, self.every, self.calls, self.length = truth, k, every, 0, 0

    def start(self, max_len):
        self.length = 0

    def extend(self, x, tokens):
        self.length += len(tokens)

    def draft(self, k):
        self.calls += 1
        out = []
        for j in range(k):
            t = self.truth[self.length + j + 1] if self.length + j + 1 < len(self.truth) else 0
            out.append((t + 1) % 700 if (self.calls + j) % self.every == 0 else t)
        return out


@pytest.mark.parametrize("preset", PRESETS)
def test_speculative_is_plain_greedy_whatever_the_drafts(models, preset):
    """Rounds that accept none, some or all of k drafts (k 1, 2, 5): the tokens are plain greedy decoding's."""
    model = models[preset]
    p = Sampling(max_new_tokens=30)
    with one_thread():
        prompt = ids(19, 7)
        plain = generate(model, prompt, p).tokens
        for k in (1, 2, 5):
            for every in (2, 3, 5):
                res = generate_speculative(model, prompt, p, drafter=Oracle(prompt + plain, k, every), k=k)
                assert res.tokens == plain, (k, every)
                assert 0 < res.stats.acceptance < 1 and res.stats.tokens_per_step > 1
                assert res.stats.tokens + 1 == len(plain)  # the prefill gives the first token


@pytest.mark.parametrize("preset", PRESETS)
def test_speculative_with_the_draft_heads_is_plain_greedy(models, preset):
    """The conversion's own (seeded) draft head, chained k times: plain greedy's tokens, with stats."""
    model = models[preset]
    p = Sampling(max_new_tokens=24)
    with one_thread():
        for seed in (3, 4):
            prompt = ids(17 + seed, seed)
            plain = generate(model, prompt, p).tokens
            for k in (None, 3):
                res = generate_speculative(model, prompt, p, k=k)
                assert res.tokens == plain
                assert len(res.stats.proposed) == (k or 1) and res.stats.steps == len(plain) - 1


def test_chat_turns_with_a_drafter_follow_the_cache(conversion):
    """Two chat turns, the second continuing the first's cache (the drafter goes back one position and reads the
    next turn's tokens): the same tokens as plain chat, on V4 whose cache only rewinds to a mark."""
    from engine.chat.session import Session
    from engine.inputs.tokenizer import Tokenizer

    out = conversion("tiny-dsv4", tp=1)
    with one_thread():
        model = Model.from_converted(out, dtype=torch.float32)
        tok = Tokenizer(out)
        turns = {}
        for spec in (False, True):
            s = Session(model, tok, Sampling(max_new_tokens=12, stop_ids=tok.stop_ids), None, 512, speculative=spec)
            for text in ("def main(", "return x"):
                s.turn(text, None, None)
            turns[spec] = s.cached
    assert turns[True] == turns[False]


def chat(out, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine.chat", str(out), "--prompt", "def main(", "--complete",
                           "--max-new-tokens", "24", "--dtype", "fp32", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("layout", [{"tp": 2}, {"tp": 1, "pp": 2}], ids=["tp2", "pp2"])
def test_chat_speculative_prints_plain_greedy_text_and_its_acceptance(conversion, preset, layout):
    """python -m engine.chat OUT --speculative on 2 ranks (tp 2, or pp 2: the heads on the last stage with the
    embeddings): the text of plain greedy chat, and the acceptance and tokens per target step after it."""
    out = conversion(preset, **layout)
    plain, spec = chat(out), chat(out, "--speculative", "--draft-tokens", "2")
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr[-2000:]
    text = lambda r: r.stdout.rsplit("\n[TTFT", 1)[0]  # noqa: E731
    assert text(spec) == text(plain) and text(plain).startswith("def main(")
    assert "acceptance" in spec.stdout and "tokens/target step" in spec.stdout


def test_chat_speculative_refuses_what_it_cannot_do(conversion, checkpoint, tmp_path):
    from helpers import shard_job
    from kconvert.convert.shard.job import shard

    bare = shard(shard_job(checkpoint("tiny-dsv32-mtp"), tmp_path / "bare", tp=1, keep_mtp=False)).out
    assert_one_line_error(chat(bare, "--speculative"), "no draft heads")
    assert_one_line_error(chat(conversion("tiny-dsv4", tp=1), "--speculative", "--temperature", "0.7"), "greedily")
    assert_one_line_error(chat(conversion("tiny-dsv4", tp=1), "--draft-tokens", "2"), "--speculative")
