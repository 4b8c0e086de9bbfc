"""The export formats by name, and which one a quantization_config describes: what `inspect`, `verify` and
the CLI's help need without torch (the formats' tensor work is kconvert/convert/export/formats.py)."""

from __future__ import annotations

from dataclasses import dataclass

from kconvert.quant.scheme import COMPRESSED_TENSORS, KCONVERT, MODELOPT


@dataclass(frozen=True)
class ExportFormat:
    """A scheme's values under a serving engine's names: which scheme, which encoding, which tensors."""

    name: str
    scheme: str  # in kconvert/quant/registry.py; "" for none (bf16: every stored tensor dequantized)
    transform: str  # what the plan calls a tensor this format quantizes
    encoding: str = KCONVERT
    text_only: bool = False  # vision tower and projector stay bf16 (the FP8 releases keep them so)
    runs_as: str = "none"  # the `shard --quant` an engine runs it with, without rounding twice (verify, chat)


EXPORT_FORMATS = {f.name: f for f in (
    ExportFormat("fp8-block", "fp8", "fp8_block", text_only=True, runs_as="fp8"),  # blocks copied
    ExportFormat("w4a16", "int4", "int4", encoding=COMPRESSED_TENSORS),  # dequantized to bf16
    ExportFormat("w8a8-int8", "int8", "int8_channel", runs_as="int8"),  # re-quantizes to the same bytes
    ExportFormat("fp8-channel", "fp8_channel", "fp8_channel"),
    ExportFormat("bf16", "", "bf16"),  # the release's layout unquantized (dequantized: formats.py `Exported`)
    # NVIDIA Model-Optimizer's NVFP4 layout (export/nvfp4_layout.py): experts copied or cast exactly from MXFP4
    ExportFormat("nvfp4", "nvfp4", "nvfp4", encoding=MODELOPT, runs_as="nvfp4"),
    ExportFormat("nvfp4-ct", "nvfp4", "nvfp4", encoding=COMPRESSED_TENSORS),  # nvfp4-pack-quantized: dequantized
)}
FORMATS = tuple(EXPORT_FORMATS)


def runs_as(qc: dict) -> str:
    """The `shard --quant` that runs a checkpoint with this quantization_config (an export or a release)."""
    fmt = format_of(qc)
    return EXPORT_FORMATS[fmt].runs_as if fmt in EXPORT_FORMATS else "none"


def format_of(qc: dict) -> str | None:
    """The export format a checkpoint's quantization_config describes (the inverse of
    `quantization_config`): a name of FORMATS, "none" when unquantized, None when no format here reads it."""
    if not qc:
        return "none"
    # NVIDIA's NVFP4: Model-Optimizer's checkpoints, and DeepSeek-V4's FP8 releases with NVFP4 experts
    if qc.get("moe_quant_algo") == "NVFP4" or qc.get("quant_method") in ("modelopt", "modelopt_mixed"):
        return "nvfp4"
    if qc.get("quant_method") == "fp8":
        return "fp8-block"
    by_ct_format = {"pack-quantized": "w4a16", "int-quantized": "w8a8-int8", "float-quantized": "fp8-channel",
                    "nvfp4-pack-quantized": "nvfp4-ct"}
    return by_ct_format.get(qc.get("format")) if qc.get("quant_method") == "compressed-tensors" else None
