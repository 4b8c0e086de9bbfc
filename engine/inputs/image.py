"""Image preprocessing, one processor per family (`[family.engine] image_processor`, PROCESSORS below; Pillow +
torch). `kimi` (Kimi-K2.5 / K3's MoonViT), following transformers' Kimi_K25 image processor rules: shrink (never
enlarge) to at most `max_patches` patches and `max_side` patches per side, pad right/bottom to multiples of
patch x merge, scale to [0, 1], normalise with mean = std = 0.5, cut into patches. `deepseek_v41`: DeepSeek-V4.1's
rules (engine/models/deepseek_v41/image.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from kconvert.arguments import path_name
from kconvert.errors import ImageError, UsageError

# Larger inputs are shrunk to the tower's budget (max_patches x patch^2 = 3.2 Mpx), so decoding an image far
# beyond it buys nothing and lets a small file (a "decompression bomb") claim gigabytes: refuse past 16x.
INPUT_PIXELS_PER_TOWER_PIXEL = 16


@dataclass(frozen=True)
class ImageRules:
    patch_size: int = 14
    merge: int = 2
    max_patches: int = 16384
    max_side: int = 512  # patches per side
    mean: tuple = (0.5, 0.5, 0.5)
    std: tuple = (0.5, 0.5, 0.5)

    @property
    def tower_pixels(self) -> int:
        """The most pixels an image keeps."""
        return self.max_patches * self.patch_size ** 2

    @property
    def max_input_pixels(self) -> int:
        """The largest image (width x height) decoded at all."""
        return self.tower_pixels * INPUT_PIXELS_PER_TOWER_PIXEL


def target_size(height: int, width: int, r: ImageRules) -> tuple[tuple[int, int], tuple[int, int]]:
    """((resized h, w), (padded h, w)) as the Kimi processor computes them."""
    ph, pw = max(1.0, height // r.patch_size), max(1.0, width // r.patch_size)
    scale = min(1.0, math.sqrt(r.max_patches / (ph * pw)), r.max_side * r.patch_size / height,
                r.max_side * r.patch_size / width)
    h, w = max(1, int(height * scale)), max(1, int(width * scale))
    h, w = min(h, r.max_side * r.patch_size), min(w, r.max_side * r.patch_size)
    f = r.merge * r.patch_size
    return (h, w), (h + (f - h % f) % f, w + (f - w % f) % f)


def load_image(path, rules: ImageRules = ImageRules()) -> "PIL.Image.Image":
    """The image at `path` as RGB; ImageError (one line naming the file) for anything else, including
    images larger than rules.max_input_pixels, which are refused before their pixels are decoded."""
    import warnings

    from PIL import Image

    from kconvert.io.regular import regular_file

    try:
        path_name(path, "image")  # an over-long name fails in the OS call below, not as one line
    except UsageError as e:
        raise ImageError(e.message) from None
    p = Path(path).expanduser()
    limit = rules.max_input_pixels
    if not p.is_file():
        raise ImageError("image file not found" if not p.exists() else "not a file", file=str(p))
    saved = Image.MAX_IMAGE_PIXELS
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            Image.MAX_IMAGE_PIXELS = limit  # Pillow's own check, at open (warns past it, raises past twice it)
            with Image.open(regular_file(p, ImageError)) as im:  # (a FIFO renamed in after is_file: refused)
                w, h = im.size  # from the header: nothing decoded yet
                if w * h > limit:
                    raise ImageError(f"{w}x{h} = {w * h / 1e6:.0f} Mpx: larger than the {limit / 1e6:.0f} Mpx "
                                     "this engine decodes (the vision tower uses at most "
                                     f"{rules.tower_pixels / 1e6:.1f} Mpx); shrink it first",
                                     file=str(p))
                im.load()
                return im.convert("RGB")
    except ImageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ImageError(f"more pixels than the {limit / 1e6:.0f} Mpx this engine decodes (decompression bomb?)",
                         file=str(p)) from None
    except MemoryError:
        raise ImageError("decoding it ran out of memory", file=str(p)) from None
    except Exception as e:  # Pillow's decoders fail in many ways (OSError, SyntaxError, struct.error...): the file's fault
        raise ImageError(f"not a readable image ({e.__class__.__name__})", file=str(p)) from None
    finally:
        Image.MAX_IMAGE_PIXELS = saved


def preprocess(image, rules: ImageRules = ImageRules()) -> tuple[torch.Tensor, tuple[int, int]]:
    """PIL image (or path) -> (patches [gh*gw, 3, p, p] float32, (gh, gw))."""
    from PIL import Image

    if not isinstance(image, Image.Image):
        image = load_image(image, rules)
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


def _kimi_rules(vc) -> ImageRules:
    return ImageRules(patch_size=vc.patch_size, merge=vc.merge_kernel[0])


def _deepseek():
    from engine.models.deepseek_v41.image import DeepseekImageRules, preprocess_deepseek

    return DeepseekImageRules.of, preprocess_deepseek


PROCESSORS = {  # [family.engine] image_processor -> () -> (rules of a VisionConfig, preprocess(image, rules))
    "kimi": lambda: (_kimi_rules, preprocess),
    "deepseek_v41": _deepseek,
}


def preprocess_for(vc, image) -> tuple[torch.Tensor, tuple[int, int]]:
    """A PIL image or path through the processor of the model's family (vc: engine.config.VisionConfig) ->
    (patches [gh*gw, 3, p, p] float32, (gh, gw)); a path larger than that processor decodes is an ImageError."""
    from PIL import Image

    if vc.processor not in PROCESSORS:
        raise UsageError(f"no image processor {vc.processor!r} (known: {', '.join(sorted(PROCESSORS))})",
                         file="kconvert.json")
    rules_of, run = PROCESSORS[vc.processor]()
    rules = rules_of(vc)
    return run(image if isinstance(image, Image.Image) else load_image(image, rules), rules)
