"""The checkpoint's tokenizer (Kimi's tiktoken.model, or a tokenizer.json as DeepSeek releases it; with
tokenizer_config.json) and its chat template, read from the checkpoint.

Every tokenizer file must lie inside the checkpoint directory: a symlink leading out of it is refused, so a
converted directory cannot make the engine read (and tokenize) an arbitrary file of this machine."""

from __future__ import annotations

from pathlib import Path

from engine.inputs.template import render
from kconvert.io.paths import contained
from kconvert.io.side_files import MAX_CONFIG, MAX_TEXT, read_json, read_text
from kconvert.errors import CheckpointError, EngineError, TokenizerError
from kconvert.source.tokenizer import load_tokenizer

IMAGE_PLACEHOLDER = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
FILES = ("tiktoken.model", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _inside(d: Path, name: str) -> Path:
    """d/name, refused when it resolves (through symlinks) outside d: the one path rule, kconvert/io/paths.py."""
    p = d / name
    try:
        return contained(d, name, named_in=p)
    except CheckpointError:
        raise TokenizerError(f"is a symlink to {p.resolve()}, outside the checkpoint: refused", file=str(p)) from None


class Tokenizer:
    def __init__(self, model_dir, image_token: int | None = None):
        """`image_token`: the model's image placeholder id (engine.config.image_token_id: the key its family names),
        written as its token's text where the tokenizer is not Kimi's (whose is `<|media_pad|>`)."""
        d = Path(model_dir)
        paths = {name: _inside(d, name) for name in FILES}
        self.enc = load_tokenizer(d)
        self.kimi = paths["tiktoken.model"].exists()  # Kimi's turn format is the default only for Kimi's tokenizer
        self.cfg = self._read_config(paths["tokenizer_config.json"])
        self.specials = dict(self.enc._special_tokens)
        self.special_ids = set(self.specials.values())
        self.template, self.template_where = self._find_template(paths)
        self.media_pad, self.image_text = self.specials.get("<|media_pad|>"), IMAGE_PLACEHOLDER
        if not self.kimi and image_token is not None:  # DeepSeek-V4.1's image token, written as its text
            self.media_pad = image_token
            if image_token < self.enc.n_vocab:
                self.image_text = self.enc.decode_single_token_bytes(self.media_pad).decode("utf-8", "replace")
        eos = self.cfg.get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos  # tokenizer_config writes it either way
        self.stop_ids = {self.specials[t] for t in ("[EOS]", "<|im_end|>", "[EOT]", eos) if t in self.specials}

    @staticmethod
    def _read_config(path: Path) -> dict:
        if not path.exists():
            return {}
        cfg = read_json(path, limit=MAX_CONFIG, error=TokenizerError)
        if not isinstance(cfg, dict):
            raise TokenizerError("must be a JSON object", file=str(path))
        return cfg

    def _find_template(self, paths: dict) -> tuple[str | None, str]:
        """tokenizer_config.json's `chat_template`, else chat_template.jinja (newer releases), else none."""
        where = f"{paths['tokenizer_config.json']}: chat_template"
        t = self.cfg.get("chat_template")
        if isinstance(t, list):  # named templates [{"name", "template"}]: the default one
            t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
        if t is not None and not isinstance(t, str):
            raise TokenizerError("chat_template must be a string", file=str(paths["tokenizer_config.json"]))
        if t is None and paths["chat_template.jinja"].exists():
            p = paths["chat_template.jinja"]
            t, where = read_text(p, limit=MAX_TEXT, error=TokenizerError), str(p)
        return t, where

    def encode(self, text: str) -> list[int]:
        return self.enc.encode(text, allowed_special="all")

    def decode_bytes(self, ids, skip_special: bool = True) -> bytes:
        skip = self.special_ids if skip_special else ()  # DeepSeek's specials sit at 0..2, Kimi's past the vocabulary
        return self.enc.decode_bytes([int(i) for i in ids if int(i) not in skip and int(i) < self.enc.n_vocab])

    def decode(self, ids) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The checkpoint's chat template (jinja, sandboxed and bounded: engine/inputs/template.py) or, without
        one, Kimi's turn format."""
        if self.template:
            if not self.kimi:  # a DeepSeek template reads text content: an image is its token's text in it
                messages = [{**m, "content": self._text_of(m["content"])} for m in messages]
            context = {"messages": messages, "add_generation_prompt": add_generation_prompt, "tools": None}
            for key in ("bos_token", "eos_token"):
                if isinstance(self.cfg.get(key), str):
                    context[key] = self.cfg[key]
            return render(self.template, context, self.template_where)
        if not self.kimi:
            raise TokenizerError("has no chat_template (nor a chat_template.jinja beside it): chat needs one; "
                                 "--complete continues plain text", file=str(self.template_where).split(":")[0])
        out = []
        for m in messages:
            role = m["role"]
            tag = {"user": "<|im_user|>", "assistant": "<|im_assistant|>"}.get(role, "<|im_system|>")
            out.append(f"{tag}{role}<|im_middle|>{self._text_of(m['content'])}<|im_end|>")
        if add_generation_prompt:
            out.append("<|im_assistant|>assistant<|im_middle|>")
        return "".join(out)

    def _text_of(self, content) -> str:
        """A message's content as text: its parts joined, each image as the image placeholder."""
        if isinstance(content, str):
            return content
        return "".join(self.image_text if p["type"] in ("image", "image_url") else p.get("text", "") for p in content)

    def chat_ids(self, messages: list[dict], image_tokens: list[int]) -> list[int]:
        """Token ids of the conversation, each image's single <|media_pad|> expanded to its token count."""
        ids = self.encode(self.render(messages))
        pads = [i for i, t in enumerate(ids) if t == self.media_pad]
        if len(pads) != len(image_tokens):
            raise EngineError(f"the prompt holds {len(pads)} image placeholders for {len(image_tokens)} image(s) "
                              "(a <|media_pad|> typed in the text, or a template that drops images)")
        out, prev = [], 0
        for pos, n in zip(pads, image_tokens):
            out += ids[prev:pos] + [self.media_pad] * n
            prev = pos + 1
        return out + ids[prev:]
