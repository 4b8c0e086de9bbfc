"""Image preprocessing for MoonViT, following transformers' Kimi_K25 image processor rules (Pillow + torch):
shrink (never enlarge) to at most `max_patches` patches and `max_side` patches per side, pad right/bottom
to multiples of patch x merge, scale to [0, 1], normalise with mean = std = 0.5, cut into patches."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from kconvert.errors import KConvertError


@dataclass(frozen=True)
class ImageRules:
    patch_size: int = 14
    merge: int = 2
    max_patches: int = 16384
    max_side: int = 512  # patches per side
    mean: tuple = (0.5, 0.5, 0.5)
    std: tuple = (0.5, 0.5, 0.5)


def target_size(height: int, width: int, r: ImageRules) -> tuple[tuple[int, int], tuple[int, int]]:
    """((resized h, w), (padded h, w)) as the Kimi processor computes them."""
    ph, pw = max(1.0, height // r.patch_size), max(1.0, width // r.patch_size)
    scale = min(1.0, math.sqrt(r.max_patches / (ph * pw)), r.max_side * r.patch_size / height,
                r.max_side * r.patch_size / width)
    h, w = max(1, int(height * scale)), max(1, int(width * scale))
    h, w = min(h, r.max_side * r.patch_size), min(w, r.max_side * r.patch_size)
    f = r.merge * r.patch_size
    return (h, w), (h + (f - h % f) % f, w + (f - w % f) % f)


def load_image(path) -> "PIL.Image.Image":
    from PIL import Image, UnidentifiedImageError

    p = Path(path).expanduser()
    try:
        with Image.open(p) as im:
            im.load()
            return im.convert("RGB")
    except FileNotFoundError:
        raise KConvertError("image file not found", file=str(p)) from None
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise KConvertError(f"not a readable image ({e.__class__.__name__})", file=str(p)) from None


def preprocess(image, rules: ImageRules = ImageRules()) -> tuple[torch.Tensor, tuple[int, int]]:
    """PIL image (or path) -> (patches [gh*gw, 3, p, p] float32, (gh, gw))."""
    from PIL import Image

    if not isinstance(image, Image.Image):
        image = load_image(image)
    image = image.convert("RGB")
    (h, w), (H, W) = target_size(image.height, image.width, rules)
    if (h, w) != (image.height, image.width):
        image = image.resize((w, h), Image.BICUBIC)
    data = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(h, w, 3).permute(2, 0, 1)
    x = torch.zeros(3, H, W)
    x[:, :h, :w] = data.float() / 255.0
    mean, std = torch.tensor(rules.mean)[:, None, None], torch.tensor(rules.std)[:, None, None]
    x = (x - mean) / std
    p = rules.patch_size
    gh, gw = H // p, W // p
    patches = x.view(3, gh, p, gw, p).permute(1, 3, 0, 2, 4).reshape(gh * gw, 3, p, p)
    return patches.contiguous(), (gh, gw)
