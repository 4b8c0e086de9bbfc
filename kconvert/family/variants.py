"""Which release of its family a checkpoint is: the family manifest's `[[variants]]`, matched on what tells the
releases apart in config.json and in the stored tensors (never on widths, so the tiny release fixtures of
kconvert/fixtures/models/releases.py are recognised as their releases are). `kconvert inspect` names the first
variant whose every condition holds (a manifest lists the most specific first); none may hold (a fine-tune, an
export, a fixture of no release).

    [[variants]]
    name = "DeepSeek-V4-Flash-Base"
    release = "deepseek-ai/DeepSeek-V4-Flash-Base"
    differs = "FP8 block experts, float32 FP8 scales (expert_dtype fp8)"
    config = { expert_dtype = "fp8" }     # config.json values by dotted path (`text_config.engram_layer_ids`);
                                          # "<set>": present and not null / empty / 0, "<unset>": the opposite
    stored = { "layers.*.ffn.experts.*.w1.weight" = "F8_E4M3" }   # a stored name (* for any part) and its
                                          # dtype; "<absent>": no stored tensor matches the name
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass

from kconvert.errors import ManifestError

SET, UNSET, ABSENT = "<set>", "<unset>", "<absent>"


@dataclass(frozen=True)
class Variant:
    name: str
    release: str
    differs: str

    def to_json(self) -> dict:
        return {"name": self.name, "release": self.release, "differs": self.differs}


def recognise(family: Mapping, config: Mapping, stored_dtypes: Mapping[str, str]) -> Variant | None:
    """The first of `family`'s variants (its manifest spec: `[family]` beside `[[variants]]`) whose conditions
    hold for `config` and `stored_dtypes` (stored name -> safetensors dtype)."""
    for v in family.get("variants") or ():
        try:
            holds = all(_config_holds(config, path, want) for path, want in (v.get("config") or {}).items()) and \
                all(_stored_holds(stored_dtypes, glob, want) for glob, want in (v.get("stored") or {}).items())
        except (KeyError, TypeError) as e:
            raise ManifestError(f"bad [[variants]] entry {v.get('name')!r}: {e}") from None
        if holds:
            return Variant(str(v["name"]), str(v.get("release", "")), str(v.get("differs", "")))
    return None


def _lookup(config: Mapping, path: str):
    value = config
    for key in path.split("."):
        if not isinstance(value, Mapping):
            return None
        value = value.get(key)
    return value


def _config_holds(config: Mapping, path: str, want) -> bool:
    value = _lookup(config, path)
    present = value not in (None, 0, "", [], {}) and value is not False
    if want == SET:
        return present
    if want == UNSET:
        return not present
    return value == want and type(value) is type(want)


@functools.lru_cache(maxsize=256)
def _glob(pattern: str) -> re.Pattern:
    return re.compile("^" + ".*".join(map(re.escape, pattern.split("*"))) + "$")


def _stored_holds(stored: Mapping[str, str], pattern: str, want: str) -> bool:
    rx = _glob(pattern)
    if "*" not in pattern:
        dtype = stored.get(pattern)
        return dtype is None if want == ABSENT else dtype == want
    for name, dtype in stored.items():
        if rx.match(name):
            return want != ABSENT and dtype == want  # the first match speaks for the rest (one rule, one dtype)
    return want == ABSENT
