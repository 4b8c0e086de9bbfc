"""Chat with a converted checkpoint.

    python -m engine.chat OUT                                   interactive: /image PATH, /clear, /exit
    python -m engine.chat OUT --prompt "Describe it" --image cat.png
    torchrun --nproc-per-node 2 -m engine.chat OUT              (checkpoint converted with --tp 2)

Tokens stream as they are generated; after each answer: time to first token and decode tokens/s.
Under torchrun rank 0 owns the terminal and broadcasts every input line to the other ranks."""

from __future__ import annotations

import argparse
import codecs
import sys

import torch

from engine.generate import Sampling, generate
from engine.image import load_image, preprocess
from engine.model import Model
from engine.parallel import Parallel
from engine.tokenizer import Tokenizer
from kconvert.errors import KConvertError

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


class Session:
    def __init__(self, model: Model, tok: Tokenizer, sampling: Sampling, system: str | None, context: int):
        self.model, self.tok, self.sampling, self.system = model, tok, sampling, system
        self.cache = model.new_cache(1, context)
        self.clear()

    def clear(self):
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.images: list[tuple[torch.Tensor, tuple[int, int]]] = []  # every image of the conversation
        self.cached: list[int] = []  # tokens whose latent is in the cache
        self.cache.reset()

    def turn(self, text: str, image_path: str | None, out) -> None:
        content = text
        new_images = []
        if image_path:
            if self.model.vision is None:
                raise KConvertError("this checkpoint has no vision tower: /image is not available")
            new_images.append(preprocess(load_image(image_path)))  # large images are shrunk, never rejected
            content = [{"type": "image"}, {"type": "text", "text": text}]
        messages = self.messages + [{"role": "user", "content": content}]
        images = self.images + new_images
        counts = [self.model.vision.tokens_per_image(g) for _, g in images]
        prompt = self.tok.chat_ids(messages, counts)
        if len(prompt) + 1 > self.cache.max_len:
            raise KConvertError(f"prompt of {len(prompt)} tokens does not fit the context of {self.cache.max_len} "
                                f"tokens (/clear starts over)")
        start = len(self.cached) if prompt[:len(self.cached)] == self.cached else 0
        if start == 0:
            self.cache.reset()
        start = min(start, len(prompt) - 1)
        self.cache.length = start
        embeds = self._image_embeds(prompt, start, images, counts)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

        def show(t):
            if t not in self.sampling.stop_ids:
                out.write(decoder.decode(self.tok.decode_bytes([t])))
                out.flush()

        res = generate(self.model, prompt, self.sampling, self.cache, embeds, show if out else None, start=start)
        answer = self.tok.decode([t for t in res.tokens if t not in self.sampling.stop_ids])
        self.messages = messages + [{"role": "assistant", "content": answer}]
        self.images = images
        self.cached = prompt + res.tokens[:-1]
        if out:
            out.write(decoder.decode(b"", final=True))
            out.write(f"\n[TTFT {res.ttft_s * 1000:.0f} ms · {len(res.tokens)} tokens · "
                      f"{res.tokens_per_s:.1f} tokens/s · {res.stop_reason}]\n")
            out.flush()

    def _image_embeds(self, prompt, start, images, counts):
        """Vision features of the images whose placeholders are still to be prefilled (prompt[start:])."""
        pad = self.tok.media_pad
        before = sum(1 for t in prompt[:start] if t == pad)
        todo, seen = [], 0
        for (patches, grid), n in zip(images, counts):
            if seen >= before:
                todo.append((patches, grid))
            seen += n
        if not todo:
            return None
        if before and before not in {sum(counts[:i]) for i in range(len(counts) + 1)}:
            raise KConvertError("cache boundary inside an image")
        pix = torch.cat([p for p, _ in todo]).to(self.model.device, self.model.dtype)
        return self.model.vision(pix, [g for _, g in todo])


def _parse(argv):
    ap = argparse.ArgumentParser(prog="python -m engine.chat", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", help="converted checkpoint directory (kconvert shard OUT)")
    ap.add_argument("--prompt", help="one non-interactive turn")
    ap.add_argument("--image", help="image for the --prompt turn")
    ap.add_argument("--system", default=None)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--context", type=int, default=None, help="cache size in tokens (default: the model's maximum)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = _parse(argv)
    err = sys.stderr
    try:
        par = Parallel.from_env(a.device)
        model = Model.from_converted(a.path, device=a.device, dtype=DTYPES[a.dtype], par=par)
        tok = Tokenizer(a.path)
        sampling = Sampling(a.temperature, a.top_p, a.top_k, a.max_new_tokens, tok.stop_ids, a.seed)
        session = Session(model, tok, sampling, a.system, a.context or model.cfg.max_position_embeddings)
    except KConvertError as e:
        print(f"error: {e.one_line()}", file=err)
        return 2
    out = sys.stdout if par.rank == 0 else None
    if a.prompt is not None:
        try:
            session.turn(a.prompt, a.image, out)
        except KConvertError as e:
            print(f"error: {e.one_line()}", file=err)
            return 2
        return 0
    if out:
        print(f"{model.mc.family} · tp {par.world} · {a.device} · /image PATH, /clear, /exit", file=out)
    pending_image = None
    while True:
        line = None
        if par.rank == 0:
            try:
                line = input("> ")
            except EOFError:
                line = "/exit"
        line = par.broadcast_object(line).strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return 0
        if line == "/clear":
            session.clear()
            pending_image = None
            continue
        if line.startswith("/image"):
            path = line[len("/image"):].strip()
            try:
                if model.vision is None:
                    raise KConvertError("this checkpoint has no vision tower")
                load_image(path)
                pending_image = path
                if out:
                    print(f"[image {path} attached to the next turn]", file=out)
            except KConvertError as e:
                if out:
                    print(f"error: {e.one_line()}", file=err)
            continue
        try:
            session.turn(line, pending_image, out)
        except KConvertError as e:
            if out:
                print(f"error: {e.one_line()}", file=err)
        pending_image = None


if __name__ == "__main__":
    sys.exit(main())
