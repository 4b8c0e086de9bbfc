"""A checkpoint whose tokenizer is a Hugging Face tokenizer.json (as DeepSeek releases V3 / V3.2 / V4 / V4.1: no
tiktoken.model): read by kconvert as transformers reads it (ids, per-token bytes, the chat template's ids), and
`reference`, `verify` and chat run on such a checkpoint end to end. Bad tokenizer files are one line."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from helpers import assert_one_line_error, cli_here, verify_json
from kconvert.fixtures.tokenizers.deepseek import ASSISTANT, EOS, USER, write_deepseek_tokenizer

TEXTS = ["def main(argv):\n    return 0\n", "héllo wörld 世界 🙂\t\tx", "", "   leading and trailing   ",
         f"{USER}hi{ASSISTANT}there{EOS}", "<｜User｜ not a special", "\n\n\r\n"]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("ds-tokenizer")
    write_deepseek_tokenizer(d)
    return d


def test_ids_and_bytes_are_what_transformers_reads(tok_dir):
    from transformers import PreTrainedTokenizerFast

    from kconvert.source.tokenizer import load_tokenizer

    enc = load_tokenizer(tok_dir)
    ref = PreTrainedTokenizerFast(tokenizer_file=str(tok_dir / "tokenizer.json"))
    for text in TEXTS:
        ids = enc.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert enc.decode_bytes(ids) == text.encode(), text  # byte-level: every token's bytes, a character split too
    assert enc._special_tokens[EOS] == 1 and enc.n_vocab == 1024


def test_chat_ids_are_the_templates_as_transformers_applies_it(tok_dir):
    from transformers import AutoTokenizer

    from engine.inputs.tokenizer import Tokenizer

    ours = Tokenizer(tok_dir)
    ref = AutoTokenizer.from_pretrained(str(tok_dir))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def f(x):"},
                {"role": "assistant", "content": "return x"}, {"role": "user", "content": "and g?"}]
    assert ours.chat_ids(messages, []) == ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                                   return_dict=False)
    assert ours.stop_ids == {1}  # eos_token from tokenizer_config.json
    assert ours.decode([0, *ours.encode("x = 1"), 1]) == "x = 1"  # specials at 0..2 are skipped, not everything


def test_reference_verify_and_chat_on_a_tokenizer_json_checkpoint(tok_dir, tmp_path):
    """tiny-dsv32 with DeepSeek's tokenizer format in place of Kimi's: the reference tokenizes the prompts with it
    (chat prompts through its template), a tp 2 conversion verifies, and chat completes and answers."""
    src = tmp_path / "src"
    assert cli_here("fixture", "tiny-dsv32", src).returncode == 0
    for name in ("tiktoken.model", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        (src / name).unlink(missing_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / name, src / name)
    out, ref = tmp_path / "tp2", tmp_path / "ref.safetensors"
    for args in (("shard", src, out, "--tp", 2), ("reference", src, "--out", ref)):
        r = cli_here(*args)
        assert r.returncode == 0, r.stderr
    assert (out / "tokenizer.json").is_file()
    r, rep = verify_json(out, ref)
    assert r.returncode == 0 and rep["verdict"] == "PASS", r.stderr
    for args in (["--complete", "--prompt", "def main(", "--max-new-tokens", "4"],
                 ["--prompt", "hello", "--max-new-tokens", "4"]):  # chat starts the 2 ranks itself: a process of its own
        p = subprocess.run([sys.executable, "-m", "engine.chat", str(out), *args], capture_output=True, text=True,
                           timeout=300)
        assert p.returncode == 0 and "TTFT" in p.stdout, p.stderr


@pytest.mark.parametrize("content,needle", [
    ("{not json", "not valid JSON"),
    ('{"version": "1.0"}', "not a tokenizer.json"),
    ('{"model": {"type": "NoSuchModel"}}', "the tokenizers library cannot read it"),
])
def test_a_bad_tokenizer_json_is_one_line(tok_dir, tmp_path, content, needle):
    src = tmp_path / "src"
    assert cli_here("fixture", "tiny-dsv32", src).returncode == 0
    (src / "tiktoken.model").unlink()
    (src / "tokenizer.json").write_text(content)
    assert_one_line_error(cli_here("reference", src, "--out", tmp_path / "ref.safetensors"), "tokenizer.json", needle)


def test_no_tokenizer_at_all_is_one_line(tmp_path):
    src = tmp_path / "src"
    assert cli_here("fixture", "tiny-dsv32", src).returncode == 0
    (src / "tiktoken.model").unlink()
    assert_one_line_error(cli_here("reference", src, "--out", tmp_path / "ref.safetensors"),
                          "no tokenizer beside the checkpoint (tiktoken.model or tokenizer.json)")


def test_the_v41_preset_ships_deepseeks_tokenizer_and_runs_on_it(tmp_path, capsys):
    """tiny-dsv41 as released (tokenizer.json, no tiktoken.model): its image prompts go through the template with the
    image token's text, verify PASSes on them, and chat answers an image turn."""
    from PIL import Image

    from engine.chat import session as chat_mod

    src, out, ref = tmp_path / "src", tmp_path / "tp1", tmp_path / "ref.safetensors"
    for args in (("fixture", "tiny-dsv41", src), ("shard", src, out, "--tp", 1), ("reference", src, "--out", ref)):
        r = cli_here(*args)
        assert r.returncode == 0, r.stderr
    assert (src / "tokenizer.json").is_file() and not (src / "tiktoken.model").exists()
    r, rep = verify_json(out, ref)
    assert r.returncode == 0 and rep["verdict"] == "PASS", r.stderr
    assert rep["faithfulness"]["by_kind"]["image"]["positions"] > 0
    Image.new("RGB", (64, 48), (200, 30, 30)).save(tmp_path / "red.png")
    code = chat_mod.main([str(out), "--prompt", "what is it", "--image", str(tmp_path / "red.png"),
                          "--max-new-tokens", "3"])
    got = capsys.readouterr()
    assert code == 0 and "TTFT" in got.out, got.err
