"""Checks of a source tensor's stored parts that every reader shares: the scale grid against config.json's
block or group size (at validate, before any work), and the parts a lossless copy writes as they are (read
with the checks a dequantizing read makes). `shard` and `export` both copy through `read_parts`."""

from __future__ import annotations

from kconvert.errors import CheckpointError
from kconvert.io.safetensors_read import read_tensor
from kconvert.source.formats import LogicalTensor, check_scale_range, declared_shape, read_checked, scale_kind, tensor_scales


def read_parts(t: LogicalTensor, roles: tuple[str, ...]) -> tuple[torch.Tensor, ...]:
    """Stored parts of `t` for a lossless copy (shard's resharding, export's copies), checked as a dequantizing
    read checks them: no NaN/Inf in any part, an INT4 weight_shape that agrees with weight_packed, and scales
    that cannot decode past float32 (formats.check_scale_range, the dequantizing read's own check)."""
    parts = tuple(read_checked(t.parts[role]) for role in roles)
    if t.format == "block_fp8" and "scale" in roles and parts[roles.index("scale")].dim() == 4:  # ModelOpt's grid
        i = roles.index("scale")
        parts = parts[:i] + (parts[i][:, 0, :, 0].contiguous(),) + parts[i + 1:]
    if t.format == "int4_packed":
        declared_shape(t, parts[roles.index("shape")] if "shape" in roles else read_tensor(t.parts["shape"]))
    if t.format == "nvfp4_packed":  # its per-tensor scales finite and positive (a dequantizing read's own check)
        tensor_scales(t, dict(zip(roles, parts)))
    elif "scale" in roles:
        check_scale_range(t, parts[roles.index("scale")])
    return parts


def check_scale_shape(t: LogicalTensor, block: tuple[int, int], group: int) -> None:
    """A scale grid that matches the weight and the config's block or group size, so every reader can index
    it (a weight_block_size or group_size the stored scales do not follow used to crash the dequantizer)."""
    scale, (rows, cols) = t.parts.get("scale"), (tuple(t.shape) + (1, 1))[:2]
    if scale is None or t.format in ("fp4_packed", "nvfp4_packed") or len(t.shape) != 2:
        return  # (their grids are checked as they are folded)
    got = tuple(scale.shape)
    if len(got) == 4 and got[1] == got[3] == 1:  # ModelOpt's block FP8 scale: [row blocks, 1, column blocks, 1]
        got = (got[0], got[2])
    if t.format == "int4_packed":
        lo, hi = -(-(cols - 7) // group), -(-cols // group)
        if len(got) == 2 and got[0] == rows and lo <= got[1] <= hi:
            return
        want, why = f"[{rows}, {hi}]", f"group_size {group}"
    elif scale_kind(t) == "block":
        if got == (-(-rows // block[0]), -(-cols // block[1])):
            return
        want, why = f"[{-(-rows // block[0])}, {-(-cols // block[1])}]", f"weight_block_size {list(block)}"
    else:
        return
    raise CheckpointError(f"scale shape {list(got)} does not fit weight {list(t.shape)} with the config's {why} "
                          f"(expected {want}): config.json and the stored scales disagree", file=str(scale.file),
                          tensor=scale.name)


def check_table(t: LogicalTensor, x: torch.Tensor, bound: int, what: str) -> None:
    """An index table (tid2eid: token -> experts) holds only indices in [0, bound): a wrong one would route to a
    missing expert or another rank's."""
    bad = (x < 0) | (x >= bound)
    if x.numel() and bool(bad.any()):
        where = [int(i) for i in bad.nonzero()[0]]
        raise CheckpointError(f"entry {int(x[tuple(where)])} at {where} is outside [0, {bound}) ({what}): the table "
                              "is damaged", file=str(t.main.file), tensor=t.name)
