"""The Kimi tokenizer (tiktoken.model + tokenizer_config.json) and its chat template, read from the checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

from kconvert.errors import KConvertError
from kconvert.source.tokenizer import load_kimi_tokenizer

IMAGE_PLACEHOLDER = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"


class Tokenizer:
    def __init__(self, model_dir):
        d = Path(model_dir)
        if not (d / "tiktoken.model").exists():
            raise KConvertError("no tiktoken.model next to the checkpoint", file=str(d))
        self.enc = load_kimi_tokenizer(d)
        cfg_path = d / "tokenizer_config.json"
        self.cfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.exists() else {}
        self.specials = dict(self.enc._special_tokens)
        self.template = self.cfg.get("chat_template")
        self.media_pad = self.specials.get("<|media_pad|>")
        self.stop_ids = {self.specials[t] for t in ("[EOS]", "<|im_end|>", "[EOT]") if t in self.specials}

    def encode(self, text: str) -> list[int]:
        return self.enc.encode(text, allowed_special="all")

    def decode_bytes(self, ids, skip_special: bool = True) -> bytes:
        limit = min(self.specials.values(), default=self.enc.n_vocab) if skip_special else self.enc.n_vocab
        return self.enc.decode_bytes([int(i) for i in ids if int(i) < limit])

    def decode(self, ids) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The checkpoint's chat template (jinja) or, without one, Kimi's turn format."""
        if self.template:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            return env.from_string(self.template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                         tools=None)
        out = []
        for m in messages:
            role = m["role"]
            tag = {"user": "<|im_user|>", "assistant": "<|im_assistant|>"}.get(role, "<|im_system|>")
            content = m["content"]
            if not isinstance(content, str):
                content = "".join(IMAGE_PLACEHOLDER if p["type"] in ("image", "image_url") else p.get("text", "")
                                  for p in content)
            out.append(f"{tag}{role}<|im_middle|>{content}<|im_end|>")
        if add_generation_prompt:
            out.append("<|im_assistant|>assistant<|im_middle|>")
        return "".join(out)

    def chat_ids(self, messages: list[dict], image_tokens: list[int]) -> list[int]:
        """Token ids of the conversation, each image's single <|media_pad|> expanded to its token count."""
        ids = self.encode(self.render(messages))
        pads = [i for i, t in enumerate(ids) if t == self.media_pad]
        if len(pads) != len(image_tokens):
            raise KConvertError(f"{len(pads)} image placeholders in the prompt but {len(image_tokens)} images")
        out, prev = [], 0
        for pos, n in zip(pads, image_tokens):
            out += ids[prev:pos] + [self.media_pad] * n
            prev = pos + 1
        return out + ids[prev:]
