"""Whether a rank's weights, reserve and KV cache fit a device (the memory model is in memory.py's
docstring), and `Sizing`: everything a fit depends on but the layout and the device."""

from __future__ import annotations

from dataclasses import dataclass, field

from kconvert.convert.layout import Layout, layout_problem
from kconvert.family.manifest import ModelMap
from kconvert.quant.policy import QuantPolicy
from kconvert.plan.device_presets import GIB, DevicePreset
from kconvert.plan.kv_bytes import KVBytes
from kconvert.plan.rank_bytes import TensorGroup, copy_bytes, fp8_misaligned, rank_bytes

MEM_FRACTION = 0.92
RUNTIME_RESERVE = 2 * GIB
PREFILL_CHUNK = 8192
ACTIVATION_BUFFERS = 24


def default_reserve(hidden_size: int) -> int:
    """Activation/workspace reserve per rank (see memory.py's docstring)."""
    return RUNTIME_RESERVE + PREFILL_CHUNK * hidden_size * 2 * ACTIVATION_BUFFERS


def capped(context: int | None, limit: int) -> int | None:
    """A context that fits, at most the model's max_position_embeddings (`limit`; 0 when the config has none):
    memory alone would offer more than the model reads (None, any context: sliding windows only)."""
    return context if not limit else limit if context is None else min(context, limit)


def fit(device: DevicePreset, weights: int, reserve: int, kv: KVBytes, context: int, batch: int,
        mem_fraction: float, limit: int = 0) -> dict:
    usable = int(device.memory_bytes * mem_fraction)
    need_kv = batch * kv.context_bytes(context)
    free = usable - weights - reserve
    return {
        "device": device.key,
        "device_name": device.name,
        "device_bytes": device.memory_bytes,
        "usable_bytes": usable,
        "weights_bytes": weights,
        "reserve_bytes": reserve,
        "kv_bytes": need_kv,
        "fits": weights + reserve + need_kv <= usable,
        "headroom_bytes": free - need_kv,  # negative: the shortfall
        "max_context": capped(kv.max_context(free, batch), limit),
    }


@dataclass(frozen=True)
class Sizing:
    """Everything but the layout and the device: the model's tensors, the scheme, the workload."""

    groups: tuple[TensorGroup, ...]
    policy: QuantPolicy
    n_experts: int
    kv: KVBytes
    reserve: int
    context: int
    batch: int
    mem_fraction: float
    model: ModelMap | None = field(default=None, compare=False, repr=False)  # whose dims a layout must divide
    max_position: int = 0  # the model's max_position_embeddings (0: none in its config): no max context past it
    _copies: dict = field(default_factory=dict, compare=False, repr=False)  # Layout -> copies(layout)
    _problems: dict = field(default_factory=dict, compare=False, repr=False)  # Layout -> problem(layout)

    def problem(self, layout: Layout) -> str | None:
        """Why the model's dims do not divide over `layout` (convert.layout.layout_problem), once per layout: the
        plan's check, tp table and pp search ask of every degree."""
        if layout not in self._problems:
            self._problems[layout] = layout_problem(self.model, layout)
        return self._problems[layout]

    def copies(self, layout: Layout) -> list[list[int]]:
        """Every group's copy_bytes on `layout`, once: the tp table, the stage split and the pp search ask alike."""
        out = self._copies.get(layout)
        if out is None:
            out = self._copies[layout] = [copy_bytes(g, layout, self.policy) for g in self.groups]
        return out

    def per_rank(self, layout: Layout) -> list[dict[str, int]]:
        return rank_bytes(self.groups, self.copies(layout), layout.tp)

    def fit(self, device: DevicePreset, weights: int, tp: int = 1) -> dict:
        return fit(device, weights, self.reserve, self.kv.on_tp(tp), self.context, self.batch, self.mem_fraction,
                   self.max_position)

    def misaligned(self, layout: Layout) -> str | None:
        return fp8_misaligned(self.groups, layout, self.policy)
