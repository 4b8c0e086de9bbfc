"""Many small same-shape weights at once: the quantizers and the INT4 unpacker over a stack [N, R, C].

At 100k+ small tensors (a released MoE's routed experts at tiny widths, or a real model's many small
ones) the per-call cost of torch, not the data, sets shard's pace; one call over N stacked weights pays
it once. Each weight still gets its own scales (blocks and rows never span two weights), and every
operation is elementwise or an exact max, so each weight's result is bit-identical to quantizing it
alone (tests/convert/test_shard_stacks.py checks against the per-tensor schemes). What a stack cannot do in the
same bits is left out: `supports` says which schemes and options are stacked (ue8m0's log2 may round
differently in torch's vectorised loop than in its scalar tail, so it is not).
"""

from __future__ import annotations

import torch

from kconvert.io.dtypes import FP8_BLOCK
from kconvert.errors import CheckpointError
from kconvert.quant.chunks import FP8_MAX, INT8_MAX, TINY, fold_max, quantize_rows
from kconvert.quant.fp8_block import divide_blocks
from kconvert.quant.int4_group import dequantize_int4
from kconvert.quant.packing import unpack_int32_words
from kconvert.quant.scheme import KCONVERT, Options, Scheme
from kconvert.quant.stacking import STACKED_COPIES, NotStackable  # noqa: F401 (defined without torch: the plan's)


def supports(scheme: Scheme, opts: Options) -> bool:
    """Whether `quantize` takes this scheme and these options."""
    return opts.encoding == KCONVERT and (scheme.name == "int8" or (scheme.name == "fp8" and opts.scale_format == "fp32"))


def quantize(scheme: Scheme, w: torch.Tensor, opts: Options) -> list[torch.Tensor]:
    """What scheme.quantize stores for each w[i], stacked along a new leading dim."""
    if scheme.name == "fp8":
        return list(fp8_blocks(w, opts.fp8_block))
    if scheme.name == "int8":
        return list(int8_rows(w))
    raise ValueError(f"no stacked form of {scheme.name}")


def fp8_blocks(w: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, R, C] -> (e4m3 [N, R, C], float32 scales [N, ceil(R/b), ceil(C/b)]) as fp8_block.quantize_fp8_block
    gives each w[i] with fp32 scales: s = max(block amax / 448, 1e-12), q = e4m3(w / s)."""
    n, rows, cols = w.shape
    x = w.to(torch.float32)
    s = (fold_max(fold_max(x, 2, block, signed=True), 1, block) / FP8_MAX).clamp_min_(TINY)
    if not bool(torch.isfinite(s).all()):
        raise NotStackable
    q = torch.empty(n, rows, cols, dtype=torch.float8_e4m3fn)
    divide_blocks(x, s, block, q)
    return q, s


def int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, R, C] -> (int8 [N, R, C], float32 scales [N, R, 1]) as int8_channel quantizes each w[i] (the same
    row quantizer, over N x R rows): s = max(row amax / 127, 1e-12), q = round(w / s)."""
    n, rows, cols = w.shape
    try:
        q, s = quantize_rows(w.reshape(n * rows, cols), INT8_MAX, torch.int8, True, "")
    except CheckpointError:  # a non-finite row
        raise NotStackable from None
    return q.view(n, rows, cols), s.view(n, rows, 1)


def dequantize_int4_words(packed: torch.Tensor, scale: torch.Tensor, cols: int, group: int) -> torch.Tensor:
    """compressed-tensors INT4 stacked: packed int32 [N, R, W], scale [N, R, G] -> float32 [N, R, cols], as
    source.formats.dequant_int4_packed reads each weight (the same unpacker and product, over N x R rows)."""
    n, rows, words = packed.shape
    codes = unpack_int32_words(packed.reshape(n * rows, words), cols)
    return dequantize_int4(codes, scale.reshape(n * rows, -1), group).view(n, rows, cols)


# ------------------------------------------------------------------------ lossless copies of FP4 experts, stacked


def supports_copy(transform: str, opts: Options) -> bool:
    """Whether `copy_parts` takes this copy (the kconvert encoding: shard's)."""
    return opts.encoding == KCONVERT and transform in STACKED_COPIES


def copy_parts(transform: str, parts: tuple[torch.Tensor, torch.Tensor], opts: Options) -> list[torch.Tensor]:
    """What shard stores for each weight's (code pairs [N, R, C/2], e8m0 scales [N, R, C/32]): the bytes (fp4_copy:
    U8 pairs, the scales), or their exact FP8 re-encoding (fp4_to_fp8) into opts.fp8_block blocks, bit-identical to
    fp4_to_fp8.fp4_to_fp8_block of each weight. NotStackable where a block spans more octaves than one FP8 scale
    holds (and --requantize was not given): the one-by-one path refuses it, naming the tensor."""
    from kconvert.errors import UsageError
    from kconvert.quant.fp4_to_fp8 import fp4_to_fp8_block

    packed, scale = parts
    if transform == "fp4_copy":
        return [packed.view(torch.uint8).contiguous(), scale.view(torch.float8_e8m0fnu).contiguous()]
    try:  # the per-weight converter over the stack's leading dim: each weight its own blocks
        return list(fp4_to_fp8_block(packed.view(torch.uint8), scale, "", opts.fp8_block, opts.requantize))
    except UsageError:  # a block one scale cannot hold: the one-by-one path refuses it, naming the tensor
        raise NotStackable from None
