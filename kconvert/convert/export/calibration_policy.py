"""The policy a calibration (engine/calibrate) asks of an export: which weights the format quantizes and which of
them GPTQ computes, in the terms shard's QuantPolicy answers them (kconvert/quant/policy.py)."""

from __future__ import annotations

from dataclasses import dataclass

from kconvert.convert.export.formats import quantizes
from kconvert.convert.export.table import EXPORT_FORMATS


@dataclass(frozen=True)
class ExportPolicy:
    """What a calibration asks of the policy: the tensors an export format quantizes, its group. `calibrated`: the
    weights the plan stores in the format's scheme by quantizing (nvfp4: by role, the MXFP4 experts' exact casts
    left out); None: every one the format's default policy quantizes (w4a16)."""

    format: str
    group_size: int
    int4_scales: str = "amax"
    calibrated: frozenset[str] | None = None

    @property
    def scheme(self) -> str:
        return EXPORT_FORMATS[self.format].scheme

    def quantizes(self, info, shape) -> bool:
        return quantizes(self.format, info, tuple(shape), self.group_size)

    def calibrates(self, info, shape, source=None) -> bool:
        return info.name in self.calibrated if self.calibrated is not None else self.quantizes(info, shape)

    def copies_exactly(self, info, shape, source=None) -> bool:
        return self.calibrated is not None and self.quantizes(info, shape) and info.name not in self.calibrated
