"""The prompt set `kconvert reference` / `verify` run: short and long text (long ones past the DSA
index_topk so sparse attention is exercised), chat-formatted turns, and prompts with images that are
generated deterministically (no downloads). Two built-in sets: `default` (prose about the tool), and
`stdlib-heldout`, drawn from Python standard-library sources the trained fixtures never saw
(HELD_OUT_FILES; a model's config.json names it with `"kconvert_prompts": "stdlib-heldout"`).
A user file (--prompts FILE, JSON list) may replace them:
    [{"id": "q1", "kind": "short", "text": "..."}, {"id": "img", "kind": "image", "text": "...",
      "image": {"seed": 1, "width": 84, "height": 56}}]
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

from kconvert.errors import MissingFileError, UsageError
from kconvert.io.side_files import MAX_CONFIG, MAX_TEXT, read_json, read_text

KINDS = ("short", "long", "chat", "image")
ROLES = ("system", "user", "assistant")
MAX_PROMPTS = 10000
MAX_PROMPT_CHARS = 4 << 20  # characters of one prompt's text and turns (far past --max-prompt-tokens' default)
MAX_PROMPT_TOKENS = 8192  # --max-prompt-tokens' default: the built-in long prompts of a real model (3 x index_topk)
MAX_TOKENS_LIMIT = 1 << 20  # the most --max-prompt-tokens takes
MAX_IMAGE_SIDE = 2048  # a generated picture's side (made pixel by pixel in Python)

_PARAGRAPH = (
    "The converter streams each layer of the checkpoint, slices it for every tensor-parallel rank, quantizes "
    "the slices and writes them with their scales. Engineers check the result against the reference model "
    "by comparing next-token distributions position by position. def route(tokens, experts): scores = "
    "sigmoid(gate(tokens)) + bias; return topk(scores, k). Sparse attention selects a fixed number of keys "
    "for every query, so long contexts cost far less than dense attention would. "
)


def default_prompts(index_topk: int | None = None, vision: bool = True) -> list[dict]:
    """Default set; long prompts reach about 3 x index_topk tokens; image prompts only with `vision`."""
    long_chars = max(600, 12 * 3 * (index_topk or 64))
    long_text = (_PARAGRAPH * (1 + long_chars // len(_PARAGRAPH)))[:long_chars]
    prompts = [
        {"id": "short-1", "kind": "short", "text": "Mixture-of-experts models route each token to a few experts."},
        {"id": "short-2", "kind": "short", "text": "print(sum(x * x for x in range(10)))"},
        {"id": "long-1", "kind": "long", "text": long_text},
        {"id": "long-2", "kind": "long", "text": long_text[len(long_text) // 3:] + long_text[: len(long_text) // 3]},
        {"id": "chat-1", "kind": "chat", "chat": [{"role": "system", "content": "You are a careful assistant."},
                                                  {"role": "user", "content": "Why quantize weights to FP8?"}]},
        {"id": "image-1", "kind": "image", "text": "Describe this picture.", "image": {"seed": 1, "width": 84, "height": 56}},
        {"id": "image-2", "kind": "image", "text": "What shapes do you see?", "image": {"seed": 2, "width": 60, "height": 90}},
    ]
    return [p for p in prompts if vision or p["kind"] != "image"]


HELD_OUT_FILES = ("graphlib.py", "sched.py", "colorsys.py")  # never in the trained fixtures' corpus
PROMPT_SETS = ("default", "stdlib-heldout")


def stdlib_text(names: tuple[str, ...]) -> str:
    """The named Python standard-library sources, concatenated (offline on every machine)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts = []
    for n in names:
        try:
            parts.append(read_text(root / n, limit=MAX_TEXT, error=UsageError))
        except MissingFileError:
            raise UsageError("missing from this Python's standard library", file=str(root / n)) from None
    return "\n\n".join(parts)


def _chunks(text: str, n_chars: int, count: int, start: int) -> tuple[list[str], int]:
    """`count` chunks of about n_chars, each starting at a line start, from offset `start`; and where they end."""
    out = []
    for _ in range(count):
        start = text.index("\n", start) + 1
        out.append(text[start:start + n_chars])
        start += n_chars
    return out, start


def heldout_prompts(index_topk: int | None = None, vision: bool = True) -> list[dict]:
    """Short, long (past 3 x index_topk tokens), chat and image prompts from held-out stdlib code."""
    text = stdlib_text(HELD_OUT_FILES)
    text = text[text.index("import "):]  # past the module docstring boilerplate
    long_chars = max(1200, 12 * 3 * (index_topk or 64))
    short, pos = _chunks(text, 240, 3, 0)
    long, pos = _chunks(text, long_chars, 3, pos)
    chat, pos = _chunks(text, 400, 1, pos)
    caption, _ = _chunks(text, 120, 2, pos)
    prompts = [{"id": f"short-{i + 1}", "kind": "short", "text": t} for i, t in enumerate(short)]
    prompts += [{"id": f"long-{i + 1}", "kind": "long", "text": t} for i, t in enumerate(long)]
    prompts.append({"id": "chat-1", "kind": "chat", "chat": [
        {"role": "system", "content": "You are a careful Python reviewer."},
        {"role": "user", "content": "What does this code do?\n" + chat[0]}]})
    if vision:
        prompts += [{"id": f"image-{i + 1}", "kind": "image", "text": t,
                     "image": {"seed": i + 1, "width": (84, 60)[i], "height": (56, 90)[i]}} for i, t in enumerate(caption)]
    return prompts


def prompts_for(config: dict) -> list[dict]:
    """The built-in set a model's config names (default: `default`), sized for it: long prompts past its
    index_topk, images only with a vision tower."""
    text = config.get("text_config", config)
    name = config.get("kconvert_prompts", "default")
    if name not in PROMPT_SETS:
        raise UsageError(f"config.json names an unknown prompt set {name!r} (known: {', '.join(PROMPT_SETS)})")
    make = heldout_prompts if name == "stdlib-heldout" else default_prompts
    return make(text.get("index_topk"), "vision_config" in config)


def load_prompts(path: str | Path | None, config: dict) -> list[dict]:
    """The prompts of --prompts: None (the set the config names), a built-in set's name, or a JSON file."""
    if path is None:
        return prompts_for(config)
    if str(path) in PROMPT_SETS:
        return prompts_for({**config, "kconvert_prompts": str(path)})
    try:
        prompts = read_json(path, limit=MAX_CONFIG, error=UsageError)
    except FileNotFoundError:
        raise UsageError("prompt file not found", file=str(path)) from None
    if not isinstance(prompts, list) or not prompts:
        raise UsageError("prompt file must hold a non-empty JSON list", file=str(path))
    if len(prompts) > MAX_PROMPTS:
        raise UsageError(f"{len(prompts)} prompts: at most {MAX_PROMPTS} a file", file=str(path))
    for i, p in enumerate(prompts):
        check_prompt(p, i, str(path))
        p.setdefault("id", f"p{i}")
    return prompts


def check_prompt(p, i: int, file: str) -> None:
    """One prompt of a --prompts file, every field of the type the runs read (a `content: 5` or an image path used to
    end in a traceback deep inside the tokenizer or the picture maker)."""
    def bad(why: str) -> UsageError:
        return UsageError(f"prompt {i}: {why}", file=file)

    if not isinstance(p, dict) or p.get("kind") not in KINDS:
        raise bad(f"needs a kind in {KINDS}")
    if "id" in p and not (isinstance(p["id"], str) and 0 < len(p["id"]) <= 200):
        raise bad("`id` must be a short string")
    text, chat = p.get("text"), p.get("chat")
    if text is not None and not isinstance(text, str):
        raise bad(f"`text` must be a string, not {type(text).__name__}")
    if chat is not None:
        if not isinstance(chat, list) or not chat:
            raise bad("`chat` must be a non-empty list of {role, content} turns")
        for j, m in enumerate(chat):
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise bad(f"chat turn {j} must be {{\"role\": one of {', '.join(ROLES)}, \"content\": a string}}")
    if not (text or chat):
        raise bad("needs a text (or chat)")
    if sum(len(t) for t in [text or ""] + [m["content"] for m in chat or []]) > MAX_PROMPT_CHARS:
        raise bad(f"over {MAX_PROMPT_CHARS} characters (--max-prompt-tokens bounds its tokens)")
    image = p.get("image")
    if image is not None:
        if not isinstance(image, dict):
            raise bad(f"`image` must be {{seed, width, height}} (a generated picture; no image file is read), not "
                      f"{type(image).__name__}")
        for key, lo, hi in (("seed", 0, 2**31 - 1), ("width", 1, MAX_IMAGE_SIDE), ("height", 1, MAX_IMAGE_SIDE)):
            v = image.get(key)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise bad(f"image.{key} = {v!r:.40}: must be an integer in [{lo}, {hi}]")


def check_lengths(inputs, limit: int, file: str | None = None) -> None:
    """Every encoded prompt (reference.encode_prompts) at most `limit` tokens: refused before any model is built (the
    MLX reference took 51 s and 0.9 GB for 2.7k tokens and crashed at 27k; the engine's cache grows with them)."""
    for i, pi in enumerate(inputs):
        n = int(pi.input_ids.numel())
        if n > limit:
            raise UsageError(f"prompt {pi.spec.get('id', i)} is {n} tokens: over --max-prompt-tokens {limit} (raise it "
                             "for longer prompts; docs/LIMITS.md)", file=file)


def synthetic_image(seed: int, width: int, height: int):
    """A deterministic RGB picture (gradients and shapes) for image prompts."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (width, height))
    px = img.load()
    for y in range(height):
        for x in range(width):
            px[x, y] = ((x * 255 // max(width - 1, 1) + 37 * seed) % 256, (y * 255 // max(height - 1, 1)) % 256,
                        (97 * seed + (x ^ y)) % 256)
    d = ImageDraw.Draw(img)
    d.ellipse([width // 5, height // 5, width // 2, height // 2], fill=((50 * seed) % 256, 200, 80))
    d.rectangle([width // 2, height // 2, width - 4, height - 4], outline=(255, 255, 255), width=2)
    return img


def prompt_patches(prompt: dict, config: dict):
    """(patches [N, 3, p, p], (gh, gw), text positions) of an image prompt's synthetic picture, preprocessed by
    the processor and vision config of the model's family (engine/inputs/image.py), its positions counted by the
    family's vision kind: the one place both the reference and the engine get their pixels from."""
    from engine.inputs.image import preprocess_for
    from engine.config import model_config
    from engine.models.registry import image_tokens
    from kconvert.family.manifest import bind

    vc = model_config(config, bind(config).family["name"]).vision
    im = prompt["image"]
    patches, grid = preprocess_for(vc, synthetic_image(im["seed"], im["width"], im["height"]))
    return patches, grid, image_tokens(vc, grid)
