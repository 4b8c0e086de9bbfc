"""NVIDIA Model-Optimizer's stored forms (and compressed-tensors' NVFP4) as logical.py folds them: an NVFP4 weight's
parts by role, its logical shape and the one-line refusal of parts whose dtypes or shapes disagree (the scale grid
against the packed codes); its block FP8 (FP8_PB_WO: `X.weight_scale` [R/128, 1, C/128, 1]) read as block FP8."""

from __future__ import annotations

from kconvert.errors import CheckpointError
from kconvert.io.safetensors_read import TensorEntry

NVFP4_GROUP = 16  # inputs per e4m3 block scale (kconvert/quant/nvfp4.py)


def scaled_format(scale: TensorEntry) -> str:
    """An FP8 / INT8 weight with a compressed-tensors-style `X.weight_scale`: `block_fp8` when the scale is
    Model-Optimizer's block grid [R/b, 1, C/b, 1], else `scaled` (per tensor, channel or a 2-D block grid)."""
    s = scale.shape
    return "block_fp8" if len(s) == 4 and s[1] == s[3] == 1 else "scaled"


def modelopt_nvfp4(name: str, stored: dict[str, TensorEntry]) -> tuple:
    """(name, shape, format, parts) of ModelOpt's `X.weight` U8 + `X.weight_scale` + `X.weight_scale_2` (+
    `X.input_scale`)."""
    e, scale = stored[name], stored.get(name + "_scale")
    if scale is None:
        raise CheckpointError(f"{name} needs a companion {name}_scale that is absent", file=str(e.file), tensor=name)
    return (name, *nvfp4_parts(e, scale, stored[name + "_scale_2"], stored.get(name[: -len("weight")] + "input_scale")))


def compressed_tensors_nvfp4(base: str, stored: dict[str, TensorEntry], used: set) -> tuple:
    """(name, shape, format, parts) of compressed-tensors' `X.weight_packed` + `X.weight_scale` +
    `X.weight_global_scale` (+ `X.input_global_scale`); the stored names it takes go into `used`."""
    names = [base + "_packed", base + "_scale", base + "_global_scale", base[: -len("weight")] + "input_global_scale"]
    if names[1] not in stored:
        e = stored[names[0]]
        raise CheckpointError(f"{names[0]} needs a companion {names[1]} that is absent", file=str(e.file), tensor=names[0])
    used.update(n for n in names if n in stored)
    return (base, *nvfp4_parts(*(stored[n] for n in names[:3]), stored.get(names[3]), divisors=True))


def nvfp4_parts(packed: TensorEntry, scale: TensorEntry, tensor_scale: TensorEntry, input_scale: TensorEntry | None,
                divisors: bool = False) -> tuple[tuple[int, int], str, dict[str, TensorEntry]]:
    """(logical shape, "nvfp4_packed", parts) of NVFP4: e2m1 code pairs U8 [R, C/2], an F8_E4M3 scale per 16 inputs
    [R, C/16] and an F32 per-tensor scale (ModelOpt's `weight_scale_2`, a multiplier, or compressed-tensors'
    `weight_global_scale`, its divisor: `divisors`), with the activations' `input_scale` / `input_global_scale` where
    stored. Shapes that disagree: refused, naming the part."""
    rows, cols = (packed.shape[0], packed.shape[1] * 2) if len(packed.shape) == 2 else (0, 0)
    want = (rows, cols // NVFP4_GROUP)
    if packed.dtype != "U8" or len(packed.shape) != 2 or cols % NVFP4_GROUP:
        raise CheckpointError(f"an NVFP4 weight must be U8 [rows, inputs / 2] with inputs a multiple of {NVFP4_GROUP}, is "
                              f"{packed.dtype}{list(packed.shape)}", file=str(packed.file), tensor=packed.name)
    if scale.dtype != "F8_E4M3" or tuple(scale.shape) != want:
        raise CheckpointError(f"NVFP4 weight {list(packed.shape)} (two e2m1 codes a byte) needs an F8_E4M3 scale "
                              f"{list(want)} (one per {NVFP4_GROUP} inputs), is {scale.dtype}{list(scale.shape)}",
                              file=str(scale.file), tensor=scale.name)
    for e in (tensor_scale, input_scale):
        if e is not None and (e.dtype != "F32" or tuple(e.shape) not in ((), (1,))):
            raise CheckpointError(f"an NVFP4 per-tensor scale must be one F32 value, is {e.dtype}{list(e.shape)}",
                                  file=str(e.file), tensor=e.name)
    parts = {"weight": packed, "scale": scale, "global_scale" if divisors else "scale_2": tensor_scale}
    if input_scale is not None:
        parts["input_global_scale" if divisors else "input_scale"] = input_scale
    return (rows, cols), "nvfp4_packed", parts
