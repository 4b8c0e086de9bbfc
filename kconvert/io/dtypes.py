"""safetensors dtype tags and their torch dtypes and sizes."""

from __future__ import annotations

# safetensors dtype tag -> (torch dtype's name, bytes per element): static, so header checks and plans need no torch
_TAGS = {
    "F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
    "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1), "U8": ("uint8", 1),
    "BOOL": ("bool", 1), "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1), "U16": ("uint16", 2),
    "U32": ("uint32", 4), "U64": ("uint64", 8), "F8_E8M0": ("float8_e8m0fnu", 1),
}
ITEMSIZE: dict[str, int] = {tag: size for tag, (_, size) in _TAGS.items()}


def __getattr__(name: str):
    """DTYPES (tag -> torch dtype) and TAGS (the reverse), built on first use: importing this module (every
    header read, `inspect`, `plan`) must not import torch (~1.5 s)."""
    if name not in ("DTYPES", "TAGS"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import torch

    dtypes = {tag: getattr(torch, n) for tag, (n, _) in _TAGS.items()}
    globals().update(DTYPES=dtypes, TAGS={v: k for k, v in dtypes.items()})
    return globals()[name]


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
# MXFP4 (OCP MX spec; DeepSeek-V4's FP4 experts): one e8m0 scale per FP4_GROUP inputs.
FP4_GROUP = 32


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """float8_e8m0fnu bytes -> float32 powers of two 2^(byte - 127), never the raw bytes as numbers. Byte 255
    is NaN: readers refuse it first (source/formats.require_finite)."""
    import torch

    return torch.exp2(scale.view(torch.uint8).to(torch.float32) - 127.0)
