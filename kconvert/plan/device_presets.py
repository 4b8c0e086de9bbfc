"""Accelerator presets (manifests/devices.toml): memory, bandwidth, FP8 support. Planning data only;
selecting a real device to load onto is kconvert.devices."""

from __future__ import annotations

import functools
import tomllib
from dataclasses import dataclass

from kconvert.errors import ManifestError, UsageError
from kconvert.family.manifest import manifests_dir

GIB = 2**30


@dataclass(frozen=True)
class DevicePreset:
    key: str
    name: str
    backend: str
    memory_gib: float
    bandwidth_tbs: float
    source: str
    aliases: tuple[str, ...] = ()
    formats: tuple[str, ...] = ()  # `--quant` formats its kernels run, best first (plan --quant auto)

    @property
    def fp8(self) -> bool:
        """Native FP8 matmul (FP8 weights on FP8 kernels, an FP8 KV cache): FP8 is among its formats."""
        return "fp8" in self.formats

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * GIB)


@functools.lru_cache(maxsize=None)
def devices() -> dict[str, DevicePreset]:
    """The presets of manifests/devices.toml, by key (H200, H100, ...)."""
    path = manifests_dir() / "devices.toml"
    try:
        spec = tomllib.loads(path.read_text())["device"]
        return {k: DevicePreset(k, d["name"], d["backend"], float(d["memory_gib"]), float(d["bandwidth_tbs"]),
                                 d.get("source", ""), tuple(d.get("aliases", ())), tuple(d.get("formats", ())))
                for k, d in spec.items()}
    except (OSError, tomllib.TOMLDecodeError, KeyError, TypeError, ValueError) as e:
        raise ManifestError(f"device presets unreadable: {e.__class__.__name__}: {e}", file=str(path)) from None


def find_device(name: str) -> DevicePreset:
    """A preset by key or alias, case-insensitively. UsageError listing the known ones otherwise."""
    want = name.strip().lower()
    for d in devices().values():
        if want == d.key.lower() or want in (a.lower() for a in d.aliases):
            return d
    raise UsageError(f"unknown --device {name!r} (known: {', '.join(devices())})")


def source_format(text_config: dict, config: dict) -> str:
    """The `--quant` name of how a source stores its routed experts: nvfp4 (NVIDIA's NVFP4 builds: DeepSeek-V4's
    `moe_quant_algo: NVFP4`, Model-Optimizer's checkpoints), fp4 (DeepSeek-V4's e2m1 experts, Kimi K3's
    compressed-tensors MXFP4), fp8 (block-FP8 releases), int4 (compressed-tensors pack-quantized), else none."""
    qc = text_config.get("quantization_config") or config.get("quantization_config") or {}
    if qc.get("moe_quant_algo") == "NVFP4" or qc.get("quant_method") in ("modelopt", "modelopt_mixed") or \
            qc.get("format") == "nvfp4-pack-quantized":
        return "nvfp4"
    if text_config.get("expert_dtype") == "fp4":
        return "fp4"
    if qc.get("quant_method") == "fp8" or text_config.get("expert_dtype") == "fp8":
        return "fp8"
    if qc.get("quant_method") == "compressed-tensors":
        return "fp4" if qc.get("format") == "mxfp4-pack-quantized" else "int4"  # Kimi K3's MXFP4 experts
    return "none"


def auto_quant(dev: DevicePreset, text_config: dict, config: dict, family: dict | None = None) -> tuple[str, str]:
    """(`--quant` for `dev`, why): on a GPU that runs NVFP4 (Blackwell), NVFP4 for the families NVIDIA ships NVFP4
    builds of (manifest `[family.nvfp4]`: Kimi K3, DeepSeek-V4) whose experts are FP4 or unquantized (MXFP4 experts
    cast exactly); otherwise the source's own format where the device runs it, else the device's first."""
    own = source_format(text_config, config)
    if "nvfp4" in dev.formats and (family or {}).get("nvfp4") and own in ("fp4", "none", "nvfp4"):
        why = {"nvfp4": f"the source's own format, which {dev.key} runs",
               "fp4": f"{dev.key} runs NVFP4 natively, as NVIDIA's builds of this family: the MXFP4 experts cast to it "
                      "exactly (same codes, finer scales); the rest as the family's NVFP4 recipe",
               "none": f"{dev.key} runs NVFP4 natively, as NVIDIA's builds of this family (experts NVFP4, the rest as "
                       "its recipe)"}[own]
        return "nvfp4", why
    if own == "none" or own in dev.formats:
        return own, f"the source's own format, which {dev.key} runs" if own != "none" else "the source is unquantized"
    pick = dev.formats[0] if dev.formats else "none"
    why = f"{dev.key} has no {own} kernels"
    if own == "fp4" and pick == "fp8":
        why += ": FP4 experts re-encoded as FP8 exactly (twice their bytes)"
    return pick, why
