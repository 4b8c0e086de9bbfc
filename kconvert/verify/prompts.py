"""The prompt set `kconvert reference` / `verify` run: short and long text (long ones past the DSA
index_topk so sparse attention is exercised), chat-formatted turns, and prompts with images that are
generated deterministically (no downloads). A user file (--prompts FILE, JSON list) may replace it:
    [{"id": "q1", "kind": "short", "text": "..."}, {"id": "img", "kind": "image", "text": "...",
      "image": {"seed": 1, "width": 84, "height": 56}}]
"""

from __future__ import annotations

import json
from pathlib import Path

from kconvert.errors import UsageError

KINDS = ("short", "long", "chat", "image")

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


def prompts_for(config: dict) -> list[dict]:
    """The default set sized for a model: long prompts past its index_topk, images only with a vision tower."""
    return default_prompts(config.get("text_config", config).get("index_topk"), "vision_config" in config)


def load_prompts(path: str | Path | None, config: dict) -> list[dict]:
    if path is None:
        return prompts_for(config)
    try:
        prompts = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UsageError("prompt file not found", file=str(path)) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"prompt file is not valid JSON: {e}", file=str(path)) from None
    if not isinstance(prompts, list) or not prompts:
        raise UsageError("prompt file must hold a non-empty JSON list", file=str(path))
    for i, p in enumerate(prompts):
        if not isinstance(p, dict) or p.get("kind") not in KINDS or not (p.get("text") or p.get("chat")):
            raise UsageError(f"prompt {i} needs a kind in {KINDS} and a text (or chat)", file=str(path))
        p.setdefault("id", f"p{i}")
    return prompts


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
    """(patches [N, 3, p, p], (gh, gw), merge) of an image prompt's synthetic picture, preprocessed by the
    vision config's rules: the one place both the reference and the engine get their pixels from."""
    from engine.image import ImageRules, preprocess

    vc = config["vision_config"]
    merge = (vc.get("merge_kernel_size") or [2, 2])[0]
    im = prompt["image"]
    patches, grid = preprocess(synthetic_image(im["seed"], im["width"], im["height"]),
                               ImageRules(patch_size=vc.get("patch_size", 14), merge=merge))
    return patches, grid, merge
