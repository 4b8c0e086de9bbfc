"""A source's quantization_config against the bytes it stores: a config that describes other bytes is refused in one
line, before any work (`check_claims`).

kconvert reads each tensor's scheme from what is stored (a U8 `weight_packed` beside a U8 `weight_scale` and no
`weight_shape` is MXFP4, one e8m0 scale per 32 values; an I32 `weight_packed` with its `weight_shape` is INT4
pack-quantized; `weight_scale_inv` is block FP8), so the numbers never depend on the config. But the config is copied
into what a conversion writes, and engines read it: a config whose scheme parameters contradict the stored bytes
(`group_size` 16 or 64, `num_bits` 8, `type: int`, another `format` beside MXFP4 bytes; `quant_method: fp8` beside
compressed-tensors tensors) would make a conversion carry a config that describes other bytes. The `ignore` list is
not read: Kimi K3's omits BF16-stored tensors (mlp_res_proj, routed_expert.*; FACTS.md), which are what they are."""

from __future__ import annotations

from collections.abc import Mapping

from kconvert.errors import CheckpointError

# compressed-tensors weight arguments of each stored packing: (num_bits, type, format names)
PACKINGS = {"MXFP4": (4, "float", ("mxfp4-pack-quantized",)), "INT4": (4, "int", ("pack-quantized",))}


def stored_packing(stored: Mapping) -> tuple[str, str, int, int] | None:
    """(packing, example tensor, its input width, its scales per row) of the first compressed-tensors packed weight
    stored, or None (the experts of a release are stored alike: the first stands for all)."""
    for name, e in stored.items():
        if not name.endswith(".weight_packed"):
            continue
        base = name[: -len("_packed")]
        scale = stored.get(base + "_scale")
        if scale is None or len(e.shape) != 2 or len(scale.shape) != 2 or not scale.shape[1]:
            return None  # the readers name what is wrong with it
        if e.dtype == "U8" and base + "_shape" not in stored:
            if -(-e.shape[1] * 2 // 32) != scale.shape[1]:
                return None  # MXFP4's group is 32 by its format: a damaged grid, which the readers name by tensor
            return "MXFP4", name, e.shape[1] * 2, scale.shape[1]
        if e.dtype == "I32":
            return "INT4", name, e.shape[1] * 8, scale.shape[1]
        return None
    return None


def check_claims(config: dict, text_key: str, stored: Mapping, *, file: str) -> None:
    """Refuse a quantization_config (the top level's, else the text config's) whose scheme contradicts the stored
    bytes, naming the field and a stored tensor that shows it."""
    qc, field = config.get("quantization_config"), "quantization_config"
    if not qc and text_key != "." and isinstance(config.get(text_key), Mapping):
        qc, field = config[text_key].get("quantization_config"), f"{text_key}.quantization_config"
    if not isinstance(qc, Mapping) or not qc:
        return
    found = stored_packing(stored)
    if found is None:
        return
    packing, example, width, scales = found
    bits, kind, formats = PACKINGS[packing]
    shown = f"the stored {packing} tensors ({example}: {width} inputs a row, {scales} scales)"

    def bad(key: str, value, why: str = "") -> CheckpointError:
        return CheckpointError(f"{field}.{key} = {value!r:.40} contradicts {shown}{why}: the config must describe the "
                               "stored bytes (it is copied into what a conversion writes)", file=file)

    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise bad("quant_method", method)
    if qc.get("format") is not None and qc["format"] not in formats + ("mixed-precision",):
        raise bad("format", qc["format"])
    # a group describing the stored packing must exist; with several (a mixed-precision config), the others describe
    # other tensors: refused only when none agrees, naming the first group's first contradiction
    first = None
    for name, g in (qc.get("config_groups") or {}).items():
        w = (g or {}).get("weights") or {}
        wrong = [(f"config_groups.{name}.weights.{k}", w[k]) for k, want in (("num_bits", bits), ("type", kind))
                 if w.get(k) is not None and w[k] != want]
        size = w.get("group_size")
        if size is not None and (not isinstance(size, int) or size < 1 or -(-width // size) != scales):
            wrong.append((f"config_groups.{name}.weights.group_size", size))
        if g.get("format") is not None and g["format"] not in formats:
            wrong.append((f"config_groups.{name}.format", g["format"]))
        if not wrong:
            return
        first = first or wrong[0]
    if first is not None:
        raise bad(*first)
