"""Generation, tokenizer + chat template, and `python -m engine.chat` on a converted tiny-k25-dsv32."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from helpers import ROOT


@pytest.fixture(scope="module")
def tiny_converted(conversion):
    return conversion("tiny-k25-dsv32", tp=1)


def chat(*args, stdin=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "engine.chat", *map(str, args)], cwd=ROOT, input=stdin,
                          capture_output=True, text=True, timeout=timeout)


def test_chat_one_turn_with_image(tiny_converted, image_file):
    p = chat(tiny_converted, "--prompt", "What is in this picture?", "--image", image_file, "--max-new-tokens", "12")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    assert "TTFT" in lines[-1] and "tokens/s" in lines[-1] and "12 tokens" in lines[-1], p.stdout
    assert len(p.stdout) > len(lines[-1]) + 1  # an answer was printed before the timing line


def test_interactive_chat_survives_bad_input(tiny_converted, image_file):
    script = f"hello\n/image /no/such.png\n/image {ROOT / 'pyproject.toml'}\n/image {image_file}\nand now?\n/clear\nbye\n/exit\n"
    p = chat(tiny_converted, "--max-new-tokens", "4", "--temperature", "0.7", "--top-p", "0.9", "--seed", "3",
             stdin=script)
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("TTFT") == 3, p.stdout
    assert "image file not found" in p.stderr and "not a readable image" in p.stderr
    assert "Traceback" not in p.stderr


def test_chat_refuses_unknown_commands_confirms_clear_and_echoes_a_completion(tiny_converted, monkeypatch, capsys):
    """`/foo` is an unknown command, not a prompt for the model; `/clear` says it cleared; --complete shows the
    prompt it continues (in this process: the interactive loop on the loaded model, stdin scripted)."""
    import io

    from engine.chat import session as chat_mod
    from engine.runtime.generate import Sampling
    from engine.model import Model
    from engine.inputs.tokenizer import Tokenizer

    model = Model.from_converted(tiny_converted, dtype=torch.float32)
    tok = Tokenizer(tiny_converted)
    session = chat_mod.Session(model, tok, Sampling(max_new_tokens=2, stop_ids=tok.stop_ids), None, 256)
    lines = iter(["/foo bar", "/clear", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    monkeypatch.setattr(session, "turn", lambda *a: pytest.fail("a command reached the model"))
    chat_mod._interactive(session, model, model.par, sys.stdout)
    out = capsys.readouterr()
    assert "error: unknown command /foo (/image, /clear, /exit)" in out.err, out.err
    assert "[conversation cleared" in out.out, out.out
    buf = io.StringIO()
    chat_mod.Session(model, tok, Sampling(max_new_tokens=2), None, 256, complete=True).turn("def main(", None, buf)
    assert buf.getvalue().startswith("def main("), buf.getvalue()


def test_chat_rejects_prompt_longer_than_context(tiny_converted):
    p = chat(tiny_converted, "--prompt", "word " * 200, "--context", "64", "--max-new-tokens", "4")
    assert p.returncode == 2 and "context" in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_generation_greedy_equals_argmax_and_stops(tiny_converted):
    from engine.runtime.generate import Sampling, generate
    from engine.model import Model

    model = Model.from_converted(tiny_converted, dtype=torch.float32)
    seed = int.from_bytes(os.urandom(4), "little")
    prompt = torch.randint(0, 768, (12,), generator=torch.Generator().manual_seed(seed)).tolist()
    res = generate(model, prompt, Sampling(max_new_tokens=6))
    ids = list(prompt)
    for _ in range(6):  # greedy generation = argmax of full forwards, token by token
        ids.append(int(model.forward(torch.tensor([ids]))[0, -1].argmax()))
    assert res.tokens == ids[12:], f"seed {seed}"
    stop = generate(model, prompt, Sampling(max_new_tokens=6, stop_ids={res.tokens[2]}))
    first = res.tokens.index(res.tokens[2])  # generation stops at the stop token's first appearance (a repeat: earlier)
    assert stop.tokens == res.tokens[:first + 1] and stop.stop_reason == "stop", f"seed {seed}"
    a = generate(model, prompt, Sampling(temperature=1.0, top_k=20, top_p=0.9, max_new_tokens=8, seed=5))
    b = generate(model, prompt, Sampling(temperature=1.0, top_k=20, top_p=0.9, max_new_tokens=8, seed=5))
    assert a.tokens == b.tokens  # seeded sampling is reproducible


def test_tokenizer_chat_template_and_image_expansion(tiny_converted):
    from engine.inputs.tokenizer import Tokenizer

    tok = Tokenizer(tiny_converted)
    text = "Hello, world! 你好"
    assert tok.decode(tok.encode(text)) == text
    ids = tok.chat_ids([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}], [6])
    assert ids.count(tok.media_pad) == 6
    rendered = tok.decode_bytes(ids, skip_special=False).decode()
    assert rendered.startswith("<|im_user|>user<|im_middle|><|media_begin|>image<|media_content|>")
    assert rendered.endswith("hi<|im_end|><|im_assistant|>assistant<|im_middle|>")


def test_streaming_never_prints_part_of_a_character(tiny_converted):
    from engine.chat.stream import TextStream
    from engine.inputs.tokenizer import Tokenizer

    tok = Tokenizer(tiny_converted)
    text = "naïve café: 你好, 世界 😀🚀 ok"
    ids = tok.encode(text)
    pieces = [tok.decode_bytes([t]) for t in ids]
    split = [p for p in pieces if p and not _is_utf8(p)]
    assert split, "the tokenizer must split some character across tokens, or this test proves nothing"
    stream = TextStream()
    shown = [stream.feed(p) for p in pieces]
    assert all("\ufffd" not in s for s in shown)  # nothing half-decoded, ever
    assert "".join(shown) + stream.close() == text
    assert stream.feed("😀".encode()[:3]) == "" and stream.close() == ""  # an answer cut mid-character: dropped
    assert stream.feed(b"\xffa") == "\ufffda"  # a byte that can never decode is replaced, as UTF-8 decoders do


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_cache_is_sized_by_use_not_by_the_config(tiny_converted):
    import dataclasses

    from engine.chat.session import Session
    from engine.runtime.generate import Sampling
    from engine.model import Model
    from engine.inputs.tokenizer import Tokenizer

    model = Model.from_converted(tiny_converted, dtype=torch.float32)
    model.cfg = dataclasses.replace(model.cfg, max_position_embeddings=1 << 20)  # a 1M-context config
    tok = Tokenizer(tiny_converted)
    session = Session(model, tok, Sampling(max_new_tokens=5, stop_ids=set()), None, model.cfg.max_position_embeddings)
    assert session.cache.max_len == 1 << 20 and session.cache.nbytes() == 0
    session.turn("hello there", None, None)
    first = session.cache.capacity
    assert first == 64 * -(-(len(session.cached) + 1) // 64)  # prompt + 5 new tokens in 64-token pages
    per_token = session.cache.nbytes() // first
    session.turn("and again", None, None)  # the cache grows with the conversation, keeping what it holds
    assert len(session.cached) < session.cache.capacity <= 2 * first + 64 and per_token > 0
    with pytest.raises(Exception, match="context"):
        Session(model, tok, Sampling(max_new_tokens=5), None, 8).turn("word " * 50, None, None)


def test_context_beyond_the_model_is_one_line(tiny_converted):
    p = chat(tiny_converted, "--prompt", "hi", "--context", "99999999", "--max-new-tokens", "2")
    assert p.returncode == 2 and "--context 99999999" in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_chat_runs_a_source_checkpoint_through_a_temporary_conversion(checkpoint, capsys):
    """`python -m engine.chat SRC` on a checkpoint that is not a converted directory (in this process): it is
    converted to a temporary tp 1 directory first, which chat says with what it cost, and removes at exit."""
    from engine.chat import session as chat_mod

    code = chat_mod.main([str(checkpoint("tiny-k25-dsv32")), "--prompt", "hello", "--max-new-tokens", "2"])
    out = capsys.readouterr()
    assert code == 0 and "TTFT" in out.out, out.err
    note = next(line for line in out.err.splitlines() if "is not a converted directory" in line)
    assert "temporary tp 1 directory (--quant none)" in note and "GB written, removed at exit" in note, note
