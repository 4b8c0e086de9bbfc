"""compressed-tensors' fake quantizer: the rounding, clamping and dequantization every faithfulness reference uses
(verify/fake_quant.py, verify/fake_quant_nvfp4.py), independent of kconvert's own quantizers."""

from __future__ import annotations

import torch

from kconvert.errors import MissingDependency


def _ct():
    try:
        from compressed_tensors.quantization import QuantizationArgs
        from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    except ImportError:
        raise MissingDependency("the faithfulness check needs compressed-tensors: pip install 'compressed-tensors>=0.20'") \
            from None
    return QuantizationArgs, fake_quantize


def fq(x: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor | None = None, **args) -> torch.Tensor:
    """x fake-quantized with these scales (NVFP4: and its global scale) under QuantizationArgs(**args)."""
    QuantizationArgs, fake_quantize = _ct()
    return fake_quantize(x, scale, torch.zeros_like(scale), QuantizationArgs(**args), global_scale=global_scale)
