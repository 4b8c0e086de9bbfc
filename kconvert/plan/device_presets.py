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
    fp8: bool
    source: str
    aliases: tuple[str, ...] = ()

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * GIB)


@functools.lru_cache(maxsize=None)
def devices() -> dict[str, DevicePreset]:
    """The presets of manifests/devices.toml, by key (H200, H100, ...)."""
    path = manifests_dir() / "devices.toml"
    try:
        spec = tomllib.loads(path.read_text())["device"]
        return {k: DevicePreset(k, d["name"], d["backend"], float(d["memory_gib"]), float(d["bandwidth_tbs"]), bool(d["fp8"]),
                          d.get("source", ""), tuple(d.get("aliases", ()))) for k, d in spec.items()}
    except (OSError, tomllib.TOMLDecodeError, KeyError, TypeError, ValueError) as e:
        raise ManifestError(f"device presets unreadable: {e.__class__.__name__}: {e}", file=str(path)) from None


def find_device(name: str) -> DevicePreset:
    """A preset by key or alias, case-insensitively. UsageError listing the known ones otherwise."""
    want = name.strip().lower()
    for d in devices().values():
        if want == d.key.lower() or want in (a.lower() for a in d.aliases):
            return d
    raise UsageError(f"unknown --device {name!r} (known: {', '.join(devices())})")
