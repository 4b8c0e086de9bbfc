"""What a calibrated conversion stores, decoded back to float32 weights: verify holds a GPTQ conversion to its own
codes (the codes are chosen from calibration data the reference does not see), so its faithful reference is built
from them (fake_quant.write_fake_quant_source) rather than from rounding the source."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from kconvert.errors import VerifyFailed
from kconvert.verify.fake_quant_nvfp4 import decode_nvfp4

Pieces = dict[str, list[tuple[list | None, torch.Tensor]]]
COMPANIONS = ("_scale_inv", "_scale", "_scale_2", ".input_scale")  # a stored weight's scale tensors


def stored_pieces(converted: str | Path | None, meta: dict) -> Pieces:
    """{source name: [(slice, float32 weight decoded from what is stored)]} of a calibrated int4 or nvfp4 conversion."""
    return {**stored_int4_pieces(converted, meta), **stored_nvfp4_pieces(converted, meta)}


def stored_int4_pieces(converted: str | Path | None, meta: dict) -> Pieces:
    """int4's nibble pairs and group scales (docs/FORMAT.md: q = nibble - 8, w = q * scale), by source name."""
    group = meta["quantization"].get("group_size") or 32

    def decode(tensors: dict, stored: str, name: str) -> torch.Tensor:
        packed, scale = tensors[stored].to(torch.int16), tensors[name + "_scale"].to(torch.float32)
        q = torch.stack([(packed & 0xF) - 8, (packed >> 4) - 8], dim=-1).reshape(packed.shape[0], -1)
        return q.to(torch.float32) * scale.repeat_interleave(group, dim=1)

    return _decoded(converted, meta, lambda t: t["transform"] == "int4" and t["name"].endswith("_packed"),
                    lambda stored: stored.removesuffix("_packed"), decode)


def stored_nvfp4_pieces(converted: str | Path | None, meta: dict) -> Pieces:
    """NVFP4's codes, block scales and weight_scale_2 (fake_quant_nvfp4.decode_nvfp4), by source name."""
    return _decoded(converted, meta, lambda t: t["transform"] == "nvfp4" and not t["name"].endswith(COMPANIONS),
                    lambda stored: stored, lambda tensors, stored, name: decode_nvfp4(
                        tensors[stored], tensors[stored + "_scale"], tensors[stored + "_scale_2"]))


def _decoded(converted, meta: dict, picks: Callable[[dict], bool], source_name: Callable[[str], str],
             decode: Callable[[dict, str, str], torch.Tensor]) -> Pieces:
    """Every stored weight `picks` selects among kconvert.json's records, decoded, one entry per distinct slice (a
    replicated tensor's one copy), reading each rank's unit once."""
    by_file: dict[tuple[int, str], list[dict]] = {}
    for t in meta["tensors"]:
        if picks(t):
            by_file.setdefault((t["rank"], t["unit"]), []).append(t)
    if by_file and converted is None:
        raise VerifyFailed("faithfulness: a calibrated conversion is checked against its own stored codes; "
                           "pass its directory (kconvert reference SRC --like OUT)")
    from kconvert.load.loader import open_converted

    out: Pieces = {}
    for (rank, unit), entries in sorted(by_file.items()):
        tensors = open_converted(converted, rank=rank).load_unit(unit)
        for t in entries:
            name = source_name(t["name"])
            if not any(s == t["slice"] for s, _ in out.get(name, [])):
                out.setdefault(name, []).append((t["slice"], decode(tensors, t["name"], name)))
    return out
