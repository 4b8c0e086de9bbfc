"""Image preprocessing for DeepSeek-V4.1's vision tower (Pillow + torch), following mlx-vlm 0.7.10's
processing_deepseek_v41 rules (tests/families/dsv41/test_dsv41_vision.py compares the patches):

1. size: a width past `max_wh_ratio` x height is clamped to it; an image below `min_pixels` is enlarged (both
   sides by the same factor, truncated); each side rounded up to a multiple of the patch size.
2. budget: if that image's span (rows x (cols + 1) + 2 text positions over r x r windows, a partial window
   counting) exceeds `max_image_tokens`, the largest aspect-preserving size whose window grid fits is taken:
   cols = floor(sqrt((N - 2) / aspect + 1/4) - 1/2) and rows = aspect x cols solve rows x (cols + 1) + 2 = N;
   the image is scaled to the tighter of the two and each side floored to a multiple of the patch size (an
   image too tall or too wide for one window per side gets a single column or row).
3. pixels: fitted inside that size keeping its aspect and centred on grey (127, 127, 127) (Pillow's
   ImageOps.pad, bicubic), or, for an image at least `max_wh_ratio` wide, stretched to it; scaled to [0, 1],
   normalised with mean = std = 0.5, cut into p x p patches in reading order."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Larger inputs are shrunk to the tower's budget anyway; decoding far beyond it buys nothing (engine/inputs/image.py)
INPUT_PIXELS_PER_TOWER_PIXEL = 16


@dataclass(frozen=True)
class DeepseekImageRules:
    patch_size: int = 14
    downsample: int = 3  # the aligner's r x r window
    min_pixels: int = 295936
    max_image_tokens: int = 1024
    max_wh_ratio: float | None = None

    @property
    def tower_pixels(self) -> int:
        """The most pixels an image keeps (its span's windows at the token budget)."""
        return self.max_image_tokens * (self.patch_size * self.downsample) ** 2

    @property
    def max_input_pixels(self) -> int:
        return max(self.tower_pixels, self.min_pixels) * INPUT_PIXELS_PER_TOWER_PIXEL

    @classmethod
    def of(cls, vc) -> "DeepseekImageRules":
        return cls(vc.patch_size, vc.merge_kernel[0], vc.min_pixels, vc.max_image_tokens, vc.max_wh_ratio)


def window_grid(height: int, width: int, r: DeepseekImageRules) -> tuple[int, int]:
    """Rows and columns of aligner windows over an image of this pixel size (a partial window counts)."""
    return math.ceil(height // r.patch_size / r.downsample), math.ceil(width // r.patch_size / r.downsample)


def span_tokens(rows: int, cols: int) -> int:
    return rows * (cols + 1) + 2


def _fit_budget(height: int, width: int, r: DeepseekImageRules) -> tuple[int, int]:
    """The largest aspect-preserving (height, width) whose window grid spans at most max_image_tokens."""
    n, aspect, cell = r.max_image_tokens, height / width, r.patch_size * r.downsample
    cols = math.sqrt((n - 2) / aspect + 0.25) - 0.5
    rows = cols * aspect
    if cols < 1.0:  # too tall for a window per column: one column, as many rows as fit
        return (n - 2) // 2 * cell, cell
    if rows < 1.0:  # too wide: one row
        return cell, (n - 3) * cell
    scale = min(math.floor(cols) * cell / width, math.floor(rows) * cell / height)
    p = r.patch_size
    return math.floor(height * scale / p) * p, math.floor(width * scale / p) * p


def plan(width: int, height: int, r: DeepseekImageRules) -> tuple[int, int, int, int]:
    """(window rows, window cols, height, width in pixels) an image of this original size is brought to."""
    p = r.patch_size
    if r.max_wh_ratio is not None and width > height * r.max_wh_ratio:
        width = int(height * r.max_wh_ratio)
    if 0 < width * height < r.min_pixels:
        grow = (r.min_pixels / (width * height)) ** 0.5
        width, height = int(width * grow), int(height * grow)
    h, w = math.ceil(height / p) * p, math.ceil(width / p) * p
    if span_tokens(*window_grid(h, w, r)) > r.max_image_tokens:
        h, w = _fit_budget(height, width, r)
    return (*window_grid(h, w, r), h, w)


def preprocess_deepseek(image, r: DeepseekImageRules) -> tuple[torch.Tensor, tuple[int, int]]:
    """RGB PIL image -> (patches [gh * gw, 3, p, p] float32, (gh, gw))."""
    from PIL import ImageOps

    image = image.convert("RGB")
    _, _, h, w = plan(image.width, image.height, r)
    if r.max_wh_ratio is not None and image.width >= r.max_wh_ratio * image.height:
        image = image.resize((w, h))
    else:
        image = ImageOps.pad(image, (w, h), color=(127, 127, 127))
    data = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(h, w, 3).permute(2, 0, 1)
    x = (data.float() / 255 - 0.5) / 0.5
    p = r.patch_size
    gh, gw = h // p, w // p
    patches = x.reshape(3, gh, p, gw, p).permute(1, 3, 0, 2, 4).reshape(gh * gw, 3, p, p)
    return patches.contiguous(), (gh, gw)
