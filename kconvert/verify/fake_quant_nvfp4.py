"""The faithfulness reference's NVFP4 (verify/fake_quant.py asks): compressed-tensors' FP4 fake-quantizer with the
scales ModelOpt's rule gives (weight_scale_2 = amax / (6 * 448) over the tensor's fused group, each block's
e4m3(block amax / 6 / weight_scale_2), an all-zero block's 1.0, none under 2^-9), or with the scales an export stores:
ModelOpt's layout divided by their float32 product, compressed-tensors' by its own global-scale form."""

from __future__ import annotations

import torch

from kconvert.verify.compressed_tensors_fq import fq

GROUP = 16
FP8_E4M3_MAX = 448.0


def nvfp4_fq(x: torch.Tensor, block_scale: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """x fake-quantized by compressed-tensors' FP4 group quantizer with Model-Optimizer's divisor, each 16-block's
    e4m3 scale times scale_2 taken in float32 (the product ModelOpt divides by and its layout dequantizes with:
    bf16 weights land exactly on midpoints often, so the divisor's rounding decides ties)."""
    per_block = block_scale.to(torch.float32) * scale_2.to(torch.float32).reshape(())
    return fq(x, per_block, num_bits=4, type="float", strategy="group", group_size=GROUP)


def ct_nvfp4_fq(x: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """x fake-quantized by compressed-tensors' own NVFP4 (tensor_group, its global scale as a divisor)."""
    return fq(x, block_scale.to(torch.float32), global_scale.to(torch.float32).reshape(1), num_bits=4, type="float",
              strategy="tensor_group", group_size=GROUP)


def nvfp4_qdq(x: torch.Tensor, tensor_amax: float | None = None) -> torch.Tensor:
    """x [R, C] float32 as a faithful nvfp4 conversion holds it; `tensor_amax` its fused group's (else its own)."""
    rows, cols = x.shape
    amax = float(x.abs().max()) if tensor_amax is None else tensor_amax
    # ModelOpt's float32 amax / (6 * 448)
    s2 = torch.tensor(amax, dtype=torch.float32) / (6.0 * FP8_E4M3_MAX) if amax > 0 else torch.tensor(1.0)
    b = x.view(rows, cols // GROUP, GROUP).abs().amax(-1) / (6.0 * s2)
    b = torch.where(b == 0, torch.ones_like(b), b).clamp(min=2.0 ** -9).to(torch.float8_e4m3fn)
    return nvfp4_fq(x, b, s2)


def stored_nvfp4_fq(x: torch.Tensor, stored) -> torch.Tensor:
    """x under an NVFP4 export's own stored scales (source.formats.LogicalTensor `stored`): ModelOpt's weight_scale_2,
    or compressed-tensors' weight_global_scale (its divisor)."""
    from kconvert.io.safetensors_read import read_tensor

    parts = stored.parts
    if "scale_2" in parts:
        return nvfp4_fq(x, read_tensor(parts["scale"]), read_tensor(parts["scale_2"]))
    return ct_nvfp4_fq(x, read_tensor(parts["scale"]), read_tensor(parts["global_scale"]))


E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def decode_nvfp4(packed: torch.Tensor, block_scale: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """float32 [R, C] of stored NVFP4 (a calibrated conversion's own codes, ModelOpt's layout): byte k holds columns
    2k (low nibble) and 2k + 1; a nibble is sign bit 3 and an index into E2M1; times its 16-block's e4m3 scale times
    weight_scale_2, that product in float32."""
    b = packed.view(torch.uint8).to(torch.int64)
    nib = torch.stack([b & 0xF, b >> 4], dim=-1).reshape(b.shape[0], -1)
    mag = torch.tensor(E2M1, dtype=torch.float32)[nib & 7]
    per_block = block_scale.to(torch.float32) * scale_2.to(torch.float32).reshape(())
    return torch.where(nib >= 8, -mag, mag) * per_block.repeat_interleave(GROUP, dim=1)


def fused_amax(src: str, names: list[str]) -> dict[str, float]:
    """{name: the largest |value| over its fused group} of nvfp4 weights `names` (w1 / w3 of an expert share one
    per-tensor scale in serving engines: the manifest's `fuse`), from the source's own values."""
    if not names:
        return {}
    from kconvert.convert.fused import fused_key
    from kconvert.source.checkpoint import Checkpoint

    ck = Checkpoint.open(src)
    groups: dict = {}
    for n in names:
        groups.setdefault(fused_key(ck.info(n)) or n, []).append(n)
    out = {}
    for members in groups.values():
        a = max(float(ck.read(m, dtype=torch.float32).abs().max()) for m in members)
        out.update((m, a) for m in members)
    return out
