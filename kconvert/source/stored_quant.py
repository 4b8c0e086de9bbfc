"""How a source checkpoint stores its quantized tensors, as the schemes' lossless copies (kconvert/quant/) ask it: its
scale format, its FP8 block, a tensor's stored format and grid, an FP8-rows table's copy."""

from __future__ import annotations

from kconvert.family.manifest import TensorInfo
from kconvert.io.dtypes import FP8_BLOCK
from kconvert.quant.scheme import SourceQuant
from kconvert.source.checkpoint import Checkpoint
from kconvert.source.formats import LogicalTensor


def source_scale_fmt(ck: Checkpoint) -> str:
    """The scale format a block-FP8 source stores: ue8m0 (power-of-two) or fp32."""
    return "ue8m0" if ck.quantization_config.get("scale_fmt") == "ue8m0" else "fp32"


def source_fp8_block(quantization_config: dict) -> int:
    """The block `--quant fp8` writes: a block-FP8 source's own square block (DeepSeek-V4.1's 32: its weights are
    then copied, not re-blocked), else 128."""
    b = (quantization_config or {}).get("weight_block_size")
    if isinstance(b, list) and len(b) == 2 and b[0] == b[1] and b[0] in (32, 64, 128):
        return int(b[0])
    return FP8_BLOCK


def source_quant(ck: Checkpoint, t: LogicalTensor, info: TensorInfo | None = None) -> SourceQuant:
    """How the source stores `t`, as a scheme's `lossless_copy` asks it. `info`: its classification where the caller
    has it (ck.block_of would classify every bucketed name at once to find it: 250k at a release's size)."""
    block = (info.rule.scale_block or ck.quant_block()) if info is not None else ck.block_of(t.name)
    return SourceQuant(t.format, block, stored_scale_fmt(ck, t), ck.int4_group(), tuple(t.parts))


def stored_scale_fmt(ck: Checkpoint, t: LogicalTensor) -> str:
    """The scale format `t` is stored in: ue8m0 where its scale is e8m0 bytes (powers of two whatever the config says:
    DeepSeek-V4's `.scale` sidecars), else the source's (source_scale_fmt)."""
    scale = t.parts.get("scale")
    return "ue8m0" if scale is not None and scale.dtype == "F8_E8M0" else source_scale_fmt(ck)


def rows_copy(ck: Checkpoint, t: LogicalTensor):
    """A tensor stored in FP8 rows (DeepSeek-V4.1's Engram tables, the manifest's `scale_block = [1, 32]`): its
    bytes, cut by whole rows, under every scheme (quant/fp8_rows.py). A source whose scales are not powers of two,
    or that is stored otherwise: UsageError naming it (the table would be written twice its size, or rounded)."""
    from kconvert.errors import UsageError
    from kconvert.quant.fp8_rows import SCHEME

    fmt = stored_scale_fmt(ck, t)
    copy = SCHEME.lossless_copy(SourceQuant(t.format, ck.block_of(t.name), fmt), None)
    if copy is None:
        raise UsageError(f"stored as {t.format} with {fmt} scales: kconvert copies this table only as the release "
                         "stores it (FP8 e4m3 rows, one power-of-two scale per 32 values)", tensor=t.name)
    return copy
