"""Reading fixture checkpoints independently of the code under test (the safetensors library,
transformers), for the test_fixtures*.py files."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

SCALE_SIZE = 64_000_000


def read_header(path: Path) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def read_all(ckpt: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(ckpt.glob("model-*.safetensors")):
        out.update(load_file(f))
    return out


def load_in_transformers(cls_name: str, path: Path, dtype=torch.bfloat16):
    import transformers

    if cls_name == "Kimi_K25ForConditionalGeneration":
        from transformers.models.kimi_k25 import Kimi_K25ForConditionalGeneration as cls
    else:
        cls = getattr(transformers, cls_name)
    return cls.from_pretrained(path, output_loading_info=True, dtype=dtype)
