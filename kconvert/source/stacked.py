"""Read many small logical weights of one shape and stored form as one stack [N, ...], dequantized as
Checkpoint.read gives each (plain: kept dtype; INT4 pack-quantized and FP4: float32), with the same checks made
over the whole stack at once. When a check fails, NotStackable: the caller reads those weights one at a
time, and that read names the file and tensor as it always has."""

from __future__ import annotations

import torch

from kconvert.io.safetensors_read import TensorEntry
from kconvert.io.stacked_read import read_stacked
from kconvert.quant.fp4_e2m1 import dequantize_fp4
from kconvert.quant.stacked import NotStackable, dequantize_int4_words
from kconvert.source.formats import FP4_TOP, LogicalTensor, all_finite, declared_shape, scale_overflow


def read_stack(t0: LogicalTensor, parts: dict[str, list[TensorEntry]], group: int) -> torch.Tensor:
    """Logical weights sharing a logical.stack_form (the first, `t0`, and each stored part's entries for all of
    them by role: LogicalByName.columns) -> [N, *shape]."""
    if t0.format == "plain":
        x = read_stacked(parts["weight"])  # a plain weight's one entry
        if not all_finite(x):
            raise NotStackable
        return x
    if t0.format == "fp4_packed":
        return _fp4_stack(t0, parts)
    shapes = read_stacked(parts["shape"]).reshape(len(parts["shape"]), -1)
    rows, cols = declared_shape(t0, shapes[0])  # a CheckpointError here: the one-by-one read names it too
    if not bool((shapes == shapes[0]).all()):
        raise NotStackable
    packed = read_stacked(parts["packed"])
    scale = read_stacked(parts["scale"])
    # every value is (code - 8) * its scale with |code - 8| <= 8: all are finite when every 8 * scale is (a
    # pass over the scales, not the values; a stack this refuses but the weights pass is read one by one)
    if not all_finite(scale.to(torch.float32) * 8):
        raise NotStackable
    return dequantize_int4_words(packed, scale, cols, group)


def _fp4_stack(t0: LogicalTensor, parts: dict[str, list[TensorEntry]]) -> torch.Tensor:
    """FP4 e2m1 experts (DeepSeek-V4's int8 pairs, Kimi K3's MXFP4 bytes) -> float32 [N, rows, cols], decoded by the
    fp4 scheme's own dequantize_fp4 (the one decoder) from their stored parts (read_fp4_parts: scales checked)."""
    n, (rows, cols) = len(parts["weight"]), t0.shape
    packed, scale = read_fp4_parts(t0, parts)
    return dequantize_fp4(packed.reshape(n * rows, -1).view(torch.uint8), scale.reshape(n * rows, -1)).view(n, rows, cols)


def read_fp4_parts(t0: LogicalTensor, parts: dict[str, list[TensorEntry]]) -> tuple[torch.Tensor, torch.Tensor]:
    """FP4 experts' stored parts (weight, scale) as two stacks (code pairs [N, R, C/2] as stored, e8m0 scales
    [N, R, C/32]), for a lossless copy of each; NotStackable past the scale check (the one-by-one read_parts names
    the tensor)."""
    n, rows = len(parts["weight"]), t0.shape[0]
    packed = read_stacked(parts["weight"])
    scale = read_stacked(parts["scale"])
    if scale_overflow(scale, FP4_TOP) is not None:  # every value is finite when 6 x the largest scale is
        raise NotStackable
    return packed.reshape(n, rows, -1), scale.reshape(n, rows, -1)
