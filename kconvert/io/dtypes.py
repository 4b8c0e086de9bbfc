"""safetensors dtype tags and their torch dtypes and sizes."""

from __future__ import annotations

import torch

# safetensors dtype tag -> torch dtype
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
    "F8_E8M0": torch.float8_e8m0fnu,
}
TAGS: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
ITEMSIZE: dict[str, int] = {tag: torch.empty(0, dtype=dt).element_size() for tag, dt in DTYPES.items()}


def specs_bytes(specs) -> int:
    """Data bytes of the tensors a writer plans, given as (name, safetensors tag, shape) triples."""
    total = 0
    for _, tag, shape in specs:
        n = ITEMSIZE[tag]
        for d in shape:
            n *= d
        total += n
    return total

# DeepSeek/Kimi block-FP8: one float32 scale per FP8_BLOCK x FP8_BLOCK block of weights (`weight_scale_inv`).
FP8_BLOCK = 128


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """float8_e8m0fnu bytes -> float32 powers of two 2^(byte - 127), never the raw bytes as numbers. Byte 255
    is NaN: readers refuse it first (source/formats.require_finite)."""
    return torch.exp2(scale.view(torch.uint8).to(torch.float32) - 127.0)
