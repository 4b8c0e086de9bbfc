"""Weights as vLLM holds them, dequantized from its parameters (the `load` job of driver.py, in the vLLM environment:
torch, safetensors and compressed-tensors only): the dtype vLLM gave each parameter decides how its values are read,
so a scale vLLM misreads shows as a wrong weight."""

from __future__ import annotations

import os

import torch

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # the FP4 e2m1 magnitudes; bit 3 is the sign
SCALES = (".weight_scale_inv", ".weight_scale", ".scale")  # a weight's scale beside it, in each layout


def _scale_values(s: torch.Tensor) -> torch.Tensor:
    """A scale parameter's values as the kernels take them: raw uint8 exponents (vLLM's MXFP4 layers) as 2^(b-127),
    float8_e8m0fnu and float parameters by value (a float32 parameter holding a copied e8m0 byte holds its number)."""
    if s.dtype == torch.uint8:
        return torch.exp2(s.to(torch.float32) - 127)
    return s.to(torch.float32)


def dequantize(w: torch.Tensor, s: torch.Tensor | None, block: list | None, shape: list | None = None) -> torch.Tensor:
    """A weight as loaded, dequantized by the layout its parameters have: int32-packed 4-bit groups (compressed-tensors,
    unpacked by its own helper), FP4 code pairs (uint8 / int8, one scale per 32 values), or a float / FP8 / int8
    weight with scales per row, per group of a row, or per block (the quantization config's `weight_block_size`)."""
    if s is None:
        return w.to(torch.float32)
    sv = _scale_values(s)
    if w.dtype == torch.int32:  # compressed-tensors pack-quantized
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

        q = unpack_from_int32(w, 4, torch.Size(shape)).to(torch.float32)
        return q * sv.repeat_interleave(q.shape[-1] // sv.shape[-1], dim=-1)
    if w.dtype in (torch.uint8, torch.int8) and sv.shape[-1] * 16 == w.shape[-1]:  # FP4 e2m1 pairs, low nibble first
        codes = w.view(torch.uint8).to(torch.int64)
        nib = torch.stack([codes & 0xF, codes >> 4], -1).flatten(-2)
        vals = E2M1[nib & 7] * torch.where(nib >= 8, -1.0, 1.0)
        return vals * sv.repeat_interleave(32, dim=-1)
    wf = w.to(torch.float32)
    rows, cols = wf.shape
    if sv.dim() == 2 and sv.shape[0] == rows and cols % sv.shape[1] == 0:  # per row, or per group of a row
        return wf * sv.repeat_interleave(cols // sv.shape[1], 1)
    b_r, b_c = block or _block_of(wf.shape, sv.shape)
    return wf * sv.repeat_interleave(b_r, 0)[:rows].repeat_interleave(b_c, 1)[:, :cols]


def _block_of(shape, grid) -> list:
    for b in (128, 64, 32, 256):
        if -(-shape[0] // b) == grid[0] and -(-shape[1] // b) == grid[1]:
            return [b, b]
    raise ValueError(f"no square block maps {tuple(shape)} onto a {tuple(grid)} scale grid")


def stored_shapes(root: str) -> dict[str, list]:
    from safetensors import safe_open

    shapes = {}
    for f in sorted(os.listdir(root)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(root, f), "pt") as h:
                shapes.update({k: h.get_slice(k).get_shape() for k in h.keys()})
    return shapes


def weights_of(shapes: dict) -> dict[str, tuple[str, str | None]]:
    """{output name: (stored weight, its stored scale or None)}: `X.weight` (+ `X.weight_scale_inv` | `X.weight_scale` |
    `X.scale`), `X.weight_packed` (+ `X.weight_scale`) as `X.weight`; every other stored tensor as itself."""
    out, parts = {}, set()
    for name in shapes:
        for stem in (".weight_packed", ".weight"):
            if name.endswith(stem):
                base = name[: -len(stem)]
                scale = next((base + s for s in SCALES if base + s in shapes), None)
                out[base + ".weight"] = (name, scale)
                parts.update({scale, base + ".weight_shape"})
                break
    for name in shapes:
        if name not in parts and not any(w == name for w, _ in out.values()):
            out[name] = (name, None)
    return out
