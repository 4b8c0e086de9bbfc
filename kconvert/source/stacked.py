"""Read many small logical weights of one shape and stored form as one stack [N, ...], dequantized as
Checkpoint.read gives each (plain: kept dtype; INT4 pack-quantized: float32), with the same checks made
over the whole stack at once. When a check fails, NotStackable: the caller reads those weights one at a
time, and that read names the file and tensor as it always has."""

from __future__ import annotations

import torch

from kconvert.io.stacked_read import read_stacked
from kconvert.quant.stacked import NotStackable, dequantize_int4_words
from kconvert.source.formats import LogicalTensor, all_finite, declared_shape

def read_stack(ts: list[LogicalTensor], group: int) -> torch.Tensor:
    """Logical weights sharing a logical.stack_form -> [N, *shape]."""
    t0 = ts[0]
    if t0.format == "plain":
        x = read_stacked([t.stored for t in ts])  # a plain weight's one entry
        if not all_finite(x):
            raise NotStackable
        return x
    shapes = read_stacked([t.stored["shape"] for t in ts]).reshape(len(ts), -1)
    rows, cols = declared_shape(t0, shapes[0])  # a CheckpointError here: the one-by-one read names it too
    if not bool((shapes == shapes[0]).all()):
        raise NotStackable
    packed = read_stacked([t.stored["packed"] for t in ts])
    scale = read_stacked([t.stored["scale"] for t in ts])
    # every value is (code - 8) * its scale with |code - 8| <= 8: all are finite when every 8 * scale is (a
    # pass over the scales, not the values; a stack this refuses but the weights pass is read one by one)
    if not all_finite(scale.to(torch.float32) * 8):
        raise NotStackable
    return dequantize_int4_words(packed, scale, cols, group)
