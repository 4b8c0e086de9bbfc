"""Every quantization scheme, by name: the one list `shard`, `export`, `plan` and the catalog read.
Adding a scheme: its module beside this one (a Scheme subclass and `SCHEME = ...`), and one line here."""

from __future__ import annotations

from kconvert.errors import UsageError
from kconvert.quant import fp4_e2m1, fp8_block, fp8_channel, fp8_rows, int4_group, int8_channel, nvfp4
from kconvert.quant.scheme import Scheme

REGISTRY: dict[str, Scheme] = {s.name: s for s in (
    fp8_block.SCHEME,
    int8_channel.SCHEME,
    int4_group.SCHEME,
    fp8_channel.SCHEME,
    fp4_e2m1.SCHEME,
    nvfp4.SCHEME,
    fp8_rows.SCHEME,  # copied, never chosen: DeepSeek-V4.1's Engram tables
)}
CALIBRATED = ("int4", "nvfp4")  # the schemes `--calibrate` computes GPTQ codes for (quant/gptq.py's grids)
NONE = "none"  # no quantization: tensors keep their dtype (dequantized sources become bf16)
# `kconvert shard --quant` choices and the kconvert.json schemes a reader accepts
SHARD_SCHEMES: tuple[str, ...] = (NONE,) + tuple(name for name, s in REGISTRY.items() if s.shard)


def get_scheme(name: str) -> Scheme:
    try:
        return REGISTRY[name]
    except KeyError:
        raise UsageError(f"unknown quantization scheme {name!r} (choose from {', '.join(REGISTRY)})") from None


def scheme_of_transform(transform: str) -> Scheme | None:
    """The scheme a plan's transform stores: the scheme's own name, or one of its lossless copies;
    None for `copy` / `bf16` (kept unquantized)."""
    return _BY_TRANSFORM.get(transform)


# asked once per output tensor: a dict, the first scheme listing a copy winning as before
_BY_TRANSFORM = {**{c: s for s in reversed(REGISTRY.values()) for c in s.copies}, **REGISTRY}
