"""The fixtures as models: logits that are not degenerate with routers that spread, the tokenizer and
chat template, and small-k25-dsv32."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from fixture_files import load_in_transformers as _load


def _logits(model, ids, hook_routers=False):
    chosen: dict[int, list] = {}
    hooks = []
    if hook_routers:
        for i, layer in enumerate(model.model.language_model.layers):
            if hasattr(layer.mlp, "gate"):
                hooks.append(layer.mlp.gate.register_forward_hook(lambda m, a, out, i=i: chosen.setdefault(i, []).append(out[2])))
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    for h in hooks:
        h.remove()
    return logits, chosen


def test_logits_are_not_degenerate_and_router_spreads(checkpoint):
    model, _ = _load("Kimi_K25ForConditionalGeneration", checkpoint("tiny-k25-dsv32"), dtype=torch.float32)
    ids = torch.randint(0, 768, (4, 64), generator=torch.Generator().manual_seed(0))
    logits, chosen = _logits(model, ids, hook_routers=True)
    vocab = logits.shape[-1]
    assert torch.isfinite(logits).all()
    top1 = logits.softmax(-1).amax(-1).mean().item()
    assert 20 / vocab <= top1 <= 0.9
    n_experts = model.config.text_config.n_routed_experts
    assert len(chosen) == 2
    for i, picks in chosen.items():
        counts = torch.bincount(torch.cat(picks).flatten(), minlength=n_experts)
        assert (counts > 0).sum() >= n_experts * 3 // 4, (i, counts)
        assert counts.max() <= 0.25 * counts.sum(), (i, counts)
    # Quantization is measurable: INT4 experts move the logits a little, not a lot.
    int4_model, _ = _load("Kimi_K25ForConditionalGeneration", checkpoint("tiny-k25-dsv32-int4"), dtype=torch.float32)
    logp, logq = logits.log_softmax(-1), _logits(int4_model, ids)[0].log_softmax(-1)
    kld = (logp.exp() * (logp - logq)).sum(-1).mean().item()
    same_top1 = (logp.argmax(-1) == logq.argmax(-1)).float().mean().item()
    assert 1e-3 < kld < 0.3 and same_top1 > 0.7, (kld, same_top1)


# ---------------------------------------------------------------- tokenizer
def test_tokenizer(checkpoint):
    from kconvert.source.tokenizer import load_kimi_tokenizer

    ck = checkpoint("tiny-k25-dsv32")
    enc = load_kimi_tokenizer(ck)
    config = json.loads((ck / "config.json").read_text())
    assert enc.n_vocab == 1024 == config["text_config"]["vocab_size"]
    base = 768
    expected = {
        "[BOS]": 0, "[EOS]": 1, "<|im_end|>": 2, "<|im_user|>": 3, "<|im_assistant|>": 4, "<|im_system|>": 10,
        "<|im_middle|>": 17, "<|media_begin|>": 18, "<|media_content|>": 19, "<|media_end|>": 20,
        "<|media_pad|>": 21, "[PAD]": 255,
    }  # offsets from 163584 in the release
    for tok, off in expected.items():
        assert enc.encode(tok, allowed_special="all") == [base + off], tok
    assert enc.encode("<|reserved_token_773|>", allowed_special="all") == [773]
    assert config["image_token_id"] == base + 21
    assert config["vision_start_token_id"] == base + 18 and config["vision_end_token_id"] == base + 20
    assert config["text_config"]["bos_token_id"] == base and config["text_config"]["eos_token_id"] == base + 1
    for text in ["Hello, world! The model reads a prompt.", "def f(x):\n    return x * 2\n", "naïve café 你好 🙂", ""]:
        ids = enc.encode(text)
        assert enc.decode(ids) == text
    assert len(enc.encode("The model reads a prompt, one token at a time")) < 20  # merges were learned
    lines = (ck / "tiktoken.model").read_text().splitlines()
    assert len(lines) == base and all(re.fullmatch(r"[A-Za-z0-9+/=]+ \d+", line) for line in lines)
    cfg = json.loads((ck / "tokenizer_config.json").read_text())
    assert len(cfg["added_tokens_decoder"]) == 256
    assert cfg["added_tokens_decoder"][str(base + 2)]["content"] == "<|im_end|>"
    assert (cfg["bos_token"], cfg["eos_token"], cfg["pad_token"]) == ("[BOS]", "[EOS]", "[PAD]")
    # transformers reads the same files (it converts tiktoken.model itself) and agrees
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(ck)
    for text in ["Hello world<|im_end|>", "HELLO it's 12345 naïve 你好\n\n  x", "def f(x):\n    return x * 2\n"]:
        assert hf.encode(text, add_special_tokens=False) == enc.encode(text, allowed_special="all"), text
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (base, base + 1, base + 255)


def test_chat_template(checkpoint):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    cfg = json.loads((checkpoint("tiny-k25-dsv32") / "tokenizer_config.json").read_text())
    template = ImmutableSandboxedEnvironment().from_string(cfg["chat_template"])
    messages = [
        {"role": "system", "content": "You are Kimi."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
        {"role": "assistant", "content": "A cat."},
        {"role": "user", "content": "Thanks"},
    ]
    text = template.render(messages=messages, add_generation_prompt=True)
    assert text == (
        "<|im_system|>system<|im_middle|>You are Kimi.<|im_end|>"
        "<|im_user|>user<|im_middle|><|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
        "What is this?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>A cat.<|im_end|>"
        "<|im_user|>user<|im_middle|>Thanks<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>"
    )


# ---------------------------------------------------------------- small-k25-dsv32 (~10-15 s on 2 cores)
@pytest.mark.skipif(bool(os.environ.get("KCONVERT_FAST")), reason="KCONVERT_FAST set: small-k25-dsv32 not built")
def test_small_k25_dsv32(checkpoint):
    """Same architecture as tiny-k25-dsv32 (whose transformers round trip is tested above), ~200M parameters."""
    from kconvert.fixtures.storage.published_names import KIMI_PATTERN

    ck = checkpoint("small-k25-dsv32")
    index = json.loads((ck / "model.safetensors.index.json").read_text())
    assert all(KIMI_PATTERN.match(n) for n in index["weight_map"])
    assert 150e6 <= index["metadata"]["total_size"] / 2 <= 250e6
    config = json.loads((ck / "config.json").read_text())["text_config"]
    for key in ("hidden_size", "q_lora_rank", "kv_lora_rank", "intermediate_size", "moe_intermediate_size"):
        assert config[key] % 128 == 0, key
