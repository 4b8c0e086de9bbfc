"""Hostile and damaged chat inputs (images, chat templates, tokenizer files) end as one line naming the file
(and field), exit 2, no traceback: never a hang, a memory blow-up or a file read from outside the checkpoint."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
import time
import zlib

import pytest

from helpers import ROOT
from kconvert.errors import ChatTemplateError, ImageError, TokenizerError

TOKENIZER_FILES = ("tiktoken.model", "tokenizer_config.json")


@pytest.fixture(scope="module")
def tokenizer_dir(checkpoint, tmp_path_factory):
    """The tiny-k25-dsv32 tokenizer files alone (what Tokenizer reads), copied so tests may damage copies of them."""
    d = tmp_path_factory.mktemp("tok") / "tok"
    d.mkdir()
    for name in TOKENIZER_FILES:
        shutil.copy(checkpoint("tiny-k25-dsv32") / name, d / name)
    return d


@pytest.fixture
def tok_copy(tokenizer_dir, tmp_path):
    d = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, d)
    return d


def png_claiming(path, width: int, height: int) -> None:
    """A valid 1x1 PNG whose header then claims width x height (a decompression bomb's header)."""
    from PIL import Image

    Image.new("RGB", (1, 1)).save(path)
    data = bytearray(path.read_bytes())
    ihdr = data.index(b"IHDR")
    data[ihdr + 4:ihdr + 12] = struct.pack(">II", width, height)
    data[ihdr + 17:ihdr + 21] = struct.pack(">I", zlib.crc32(bytes(data[ihdr:ihdr + 17])))
    path.write_bytes(bytes(data))


# ---- images -------------------------------------------------------------------------------------
def test_image_larger_than_the_limit_is_refused_before_decoding(tmp_path):
    from engine.inputs.image import ImageRules, load_image

    bomb = tmp_path / "bomb.png"
    png_claiming(bomb, 50_000, 50_000)  # 2.5 Gpx: 7.5 GB decoded, from a 70-byte file
    t0 = time.perf_counter()
    with pytest.raises(ImageError) as e:
        load_image(bomb)
    assert time.perf_counter() - t0 < 5
    assert str(bomb) in e.value.one_line() and "Mpx" in e.value.one_line()
    limit = ImageRules().max_input_pixels
    just_over = tmp_path / "over.png"
    png_claiming(just_over, limit // 1000 + 1, 1000)  # past our limit, below Pillow's own error threshold
    with pytest.raises(ImageError, match="Mpx"):
        load_image(just_over)


@pytest.mark.parametrize("content", [b"", b"\x89PNG\r\n\x1a\n" + b"\x00" * 40, b"GIF89a" + b"\xff" * 30, b"not an image"])
def test_corrupt_images_are_one_line_errors(tmp_path, content):
    from engine.inputs.image import load_image

    p = tmp_path / "broken.png"
    p.write_bytes(content)
    with pytest.raises(ImageError) as e:
        load_image(p)
    assert str(p) in e.value.one_line()


def test_truncated_image_and_directory(tmp_path):
    from PIL import Image

    from engine.inputs.image import load_image

    p = tmp_path / "cut.png"
    Image.effect_noise((300, 300), 60).convert("RGB").save(p)
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    with pytest.raises(ImageError, match="not a readable image"):
        load_image(p)
    with pytest.raises(ImageError, match="not a file"):
        load_image(tmp_path)


# ---- chat templates -----------------------------------------------------------------------------
MESSAGES = {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": True}


@pytest.mark.parametrize("template, expect", [
    ("{% for m in messages %}{{ m.content }", "syntax error"),
    ("{% set x = [] %}{{ x.append(1) }}", "refused by the sandbox"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "refused by the sandbox"),
    ("{{ 'x' * 10**10 }}", "memory"),  # one operation of 10 GB: no check between template lines could stop it
    ("{{ 'x'|center(10**10) }}", "memory"),
    ("{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}", "output too large"),  # 100 MB of output
    ("{{ raise_exception('no system role') }}", "no system role"),
])
def test_bad_templates_fail_with_one_line(template, expect):
    from engine.inputs.template import render

    with pytest.raises(ChatTemplateError) as e:
        render(template, MESSAGES, "tokenizer_config.json: chat_template")
    line = e.value.one_line()
    assert line.startswith("tokenizer_config.json: chat_template: ") and expect in line, line


def test_template_that_loops_forever_is_stopped():
    from engine.inputs.template import render

    nested = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"  # 10^10 steps
    t0 = time.perf_counter()
    with pytest.raises(ChatTemplateError, match="did not finish"):
        render(nested, MESSAGES, "tokenizer_config.json: chat_template", timeout_s=2)
    assert time.perf_counter() - t0 < 10


def test_good_template_renders():
    from engine.inputs.template import render

    assert render("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}", MESSAGES, "t") == "<user>hi"


# ---- tokenizer files ----------------------------------------------------------------------------
@pytest.mark.parametrize("damage, expect", [
    (lambda t: "!!notbase64 0\n" + t, "line 1"),
    (lambda t: t + t.splitlines()[5] + "\n", "listed twice"),
    (lambda t: t.replace(" 3\n", " 99999999\n", 1), "ranks are not"),
    (lambda t: "", "no tokens"),
])
def test_malformed_tiktoken_model(tok_copy, damage, expect):
    from engine.inputs.tokenizer import Tokenizer

    path = tok_copy / "tiktoken.model"
    path.write_text(damage(path.read_text()))
    with pytest.raises(TokenizerError) as e:
        Tokenizer(tok_copy)
    assert str(path) in e.value.one_line() and expect in e.value.one_line()


@pytest.mark.parametrize("text, expect", [
    ("{not json", "not valid JSON"),
    (json.dumps({"added_tokens_decoder": [1, 2]}), "added_tokens_decoder"),
    (json.dumps({"added_tokens_decoder": {"x": {"content": "a"}}}), "added_tokens_decoder"),
    (json.dumps({"added_tokens_decoder": {"5": {"content": 7}}}), "added_tokens_decoder"),
    (json.dumps({"chat_template": 5}), "chat_template"),
    ("[]", "JSON object"),
])
def test_malformed_tokenizer_config(tok_copy, text, expect):
    from engine.inputs.tokenizer import Tokenizer

    path = tok_copy / "tokenizer_config.json"
    path.write_text(text)
    with pytest.raises(TokenizerError) as e:
        Tokenizer(tok_copy)
    assert str(path) in e.value.one_line() and expect in e.value.one_line()


def test_tokenizer_symlink_leading_out_is_refused(tok_copy, tmp_path):
    from engine.inputs.tokenizer import Tokenizer

    outside = tmp_path / "elsewhere.model"
    shutil.move(tok_copy / "tiktoken.model", outside)
    (tok_copy / "tiktoken.model").symlink_to(outside)
    with pytest.raises(TokenizerError, match="outside the checkpoint"):
        Tokenizer(tok_copy)
    inside = tok_copy / "real.model"  # a symlink that stays inside is an ordinary file
    shutil.move(outside, inside)
    (tok_copy / "tiktoken.model").unlink()
    (tok_copy / "tiktoken.model").symlink_to(inside)
    Tokenizer(tok_copy)


# ---- end to end: python -m engine.chat -----------------------------------------------------------
@pytest.fixture(scope="module")
def converted(conversion):
    return conversion("tiny-k25-dsv32", tp=1)


def chat(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "engine.chat", *map(str, args)], cwd=ROOT, input=stdin,
                          capture_output=True, text=True, timeout=300)


def one_line(p, *needles):
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in p.stderr, (p.returncode, p.stderr)
    for n in needles:
        assert n in lines[0], (n, lines[0])


def test_chat_template_errors_end_chat_with_one_line(converted, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(converted, out)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = "{% for m in messages %}{{ m.content }"
    cfg_path.write_text(json.dumps(cfg))
    one_line(chat(out, "--prompt", "hi", "--max-new-tokens", "2"), str(cfg_path), "chat_template", "syntax error")
    (out / "tiktoken.model").write_text("!!! 0\n")
    one_line(chat(out, "--prompt", "hi", "--max-new-tokens", "2"), "tiktoken.model", "line 1")


def test_interactive_chat_survives_hostile_images(converted, tmp_path):
    bomb = tmp_path / "bomb.png"
    png_claiming(bomb, 60_000, 60_000)
    junk = tmp_path / "junk.png"
    junk.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64))
    p = chat(converted, "--max-new-tokens", "2", stdin=f"/image {bomb}\n/image {junk}\nhello\n/exit\n")
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert "Mpx" in p.stderr and str(junk) in p.stderr and p.stdout.count("TTFT") == 1, (p.stdout, p.stderr)
