"""The rotary settings of a text config, read and checked in one place: by the engine (engine/config.py, DeepSeek-V4's
and V4.1's two settings) and at bind time (config_checks.py), so a setting the engine cannot run (an unknown
`rope_type`, a `factor` written as a string, a `partial_rotary_factor` that disagrees with `qk_rope_head_dim`) is
refused by inspect and shard, naming the key, not after a conversion by the engine.

The settings live in `rope_parameters` (transformers 5) or `rope_scaling` (older configs; read where
`rope_parameters` names no type); `rope_theta` there, else at the top. DeepSeek-V4 nests two settings
(`rope_parameters.main` and `.compress`) or writes one flat setting for its compressed layers."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from kconvert.errors import ManifestError

ROPE_TYPES = ("default", "yarn")
MIN_THETA = 2.0  # frequencies are powers of theta; YaRN divides by log(theta)
_MAX_POSITIONS = 1 << 26  # limits.toml's max_position_embeddings


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    kind: str  # "default" | "yarn"
    factor: float = 1.0
    original_max: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


class _Where:
    """Which config key a rotary value came from, for messages: `text_config.rope_parameters.factor`."""

    def __init__(self, prefix: str, file: str, origin: dict[str, str]):
        self.prefix, self.file, self.origin = prefix, file, origin

    def bad(self, key: str, value, why: str) -> ManifestError:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        return ManifestError(f"{self.prefix}{self.origin.get(key, key)} = {shown}: {why} (docs/LIMITS.md)", file=self.file)

    def number(self, p: Mapping, key: str, lo: float, hi: float, *, optional: bool = True):
        v = p.get(key)
        if v is None and optional:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
            raise self.bad(key, v, f"must be a finite number in [{lo:g}, {hi:g}]")
        return v


def _section(c: Mapping, key: str, where: _Where) -> dict:
    v = c.get(key)
    if v is None:
        return {}
    if not isinstance(v, Mapping):
        raise ManifestError(f"{where.prefix}{key} = {v!r:.40}: must be an object", file=where.file)
    return dict(v)


def read_rope(c: Mapping, *, prefix: str = "", file: str = "config.json", max_positions=None) -> RopeConfig:
    """The rotary setting of config section `c` (rope_parameters, else rope_scaling; rope_theta)."""
    origin: dict[str, str] = {}
    where = _Where(prefix, file, origin)
    p = _section(c, "rope_parameters", where)
    origin.update({k: f"rope_parameters.{k}" for k in p})
    legacy = _section(c, "rope_scaling", where)
    if not p.get("rope_type") and legacy:
        origin.update({k: f"rope_scaling.{k}" for k in legacy if k not in p})
        p = {**legacy, **p}
    return _setting(p, c, where, max_positions)


def _setting(p: Mapping, c: Mapping, where: _Where, max_positions=None) -> RopeConfig:
    theta_key = "rope_theta" if "rope_theta" in p else None
    theta = where.number(p, "rope_theta", MIN_THETA, 1e12) if theta_key else where.number(c, "rope_theta", MIN_THETA, 1e12)
    theta = 10000.0 if theta is None else float(theta)
    kind = p.get("rope_type") or p.get("type") or "default"
    if kind not in ROPE_TYPES:
        key = "rope_type" if p.get("rope_type") else "type"
        raise where.bad(key, kind, f"the engine runs rope types {', '.join(ROPE_TYPES)}")
    if kind == "default":
        return RopeConfig(theta, "default")
    maxpos = c.get("max_position_embeddings", 4096) if max_positions is None else max_positions
    if isinstance(maxpos, bool) or not isinstance(maxpos, int) or not 1 <= maxpos <= _MAX_POSITIONS:
        maxpos = 4096  # limits.toml refuses such a value by its own bound
    orig = p.get("original_max_position_embeddings")
    if orig is not None and orig != 0 and (isinstance(orig, bool) or not isinstance(orig, int)
                                           or not 1 <= orig <= _MAX_POSITIONS):
        raise where.bad("original_max_position_embeddings", orig, f"must be an integer in [1, {_MAX_POSITIONS}]")
    orig = orig or maxpos
    factor = where.number(p, "factor", 1e-6, 1e6)
    if factor is None:
        factor = maxpos / orig
    beta_fast, beta_slow = where.number(p, "beta_fast", 0.0, 1e6), where.number(p, "beta_slow", 0.0, 1e6)
    mscale, mscale_all = where.number(p, "mscale", 0.0, 1e6), where.number(p, "mscale_all_dim", 0.0, 1e6)
    attention = where.number(p, "attention_factor", 0.0, 1e6)
    truncate = p.get("truncate", True)
    if not isinstance(truncate, bool):
        raise where.bad("truncate", truncate, "must be true or false")
    return RopeConfig(theta, "yarn", float(factor), orig, float(beta_fast or 32), float(beta_slow or 1), mscale,
                      mscale_all, attention, truncate)


def v4_head_dims(c: Mapping) -> tuple[int, int]:
    """(rope_dim, head_dim) of a DeepSeek-V4 / V4.1 config: the rotary tail of every head, the head width."""
    head_dim = c.get("head_dim", 512)
    rope_dim = c.get("qk_rope_head_dim")
    if not rope_dim:
        prf = c.get("partial_rotary_factor") or 64 / 512
        rope_dim = int(head_dim * prf) if isinstance(prf, (int, float)) and isinstance(head_dim, int) else 0
    return rope_dim, head_dim


def read_v4_ropes(c: Mapping, rope_dim: int, head_dim: int, *, prefix: str = "",
                  file: str = "config.json") -> tuple[RopeConfig, RopeConfig]:
    """(main, compress) of a DeepSeek-V4 / V4.1 config: transformers' nested `rope_parameters` {main, compress}, or the
    flat form (YaRN keys from rope_parameters / rope_scaling apply to the compressed layers only, with attention_factor
    1); each one's `partial_rotary_factor` must give `rope_dim` of `head_dim`."""
    origin: dict[str, str] = {}
    where = _Where(prefix, file, origin)
    rp = _section(c, "rope_parameters", where)
    maxpos = c.get("max_position_embeddings", 4096)
    if isinstance(rp.get("main"), Mapping) and isinstance(rp.get("compress"), Mapping):
        settings = [(dict(rp["main"]), "rope_parameters.main"), (dict(rp["compress"]), "rope_parameters.compress")]
    else:
        legacy = _section(c, "rope_scaling", where)
        flat = {k: v for k, v in {**legacy, **rp}.items() if k not in ("main", "compress")}
        main = {"rope_type": "default", "rope_theta": c.get("rope_theta", 10000.0)}
        comp = {**flat, "rope_theta": c.get("compress_rope_theta", 160000.0)}
        comp.setdefault("rope_type", comp.get("type", "default"))
        if comp["rope_type"] == "yarn":
            comp.setdefault("attention_factor", 1.0)
        origin_of = {k: ("rope_parameters." if k in rp else "rope_scaling.") + k for k in flat}
        if "rope_type" not in flat and "type" in flat:  # the legacy spelling of the type
            origin_of["rope_type"] = origin_of["type"]
        settings = [(main, None), (comp, origin_of)]
    out = []
    for p, names in settings:
        origin.clear()
        if isinstance(names, str):
            origin.update({k: f"{names}.{k}" for k in p})
        elif names:
            origin.update(names)
        origin.setdefault("rope_theta", "rope_theta" if names is None else "compress_rope_theta")
        prf = p.get("partial_rotary_factor", rope_dim / head_dim if head_dim else 0)
        if isinstance(prf, bool) or not isinstance(prf, (int, float)) or not math.isfinite(prf) \
                or int(head_dim * float(prf)) != rope_dim:
            raise where.bad("partial_rotary_factor", prf, f"disagrees with qk_rope_head_dim {rope_dim} of head_dim "
                            f"{head_dim}")
        out.append(_setting(p, {"max_position_embeddings": maxpos}, where))
    return out[0], out[1]
