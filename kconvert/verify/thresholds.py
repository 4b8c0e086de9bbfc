"""verify's limits, read from manifests/verify_thresholds.toml: the faithfulness limits and each scheme's cost
budget (verify/verdict.py), and the draft heads' (verify/draft.py). `--threshold KEY=VALUE` overrides win:
`faithful.KEY`, `draft.KEY`, otherwise the cost budget's KEY."""

from __future__ import annotations

import functools
import tomllib

from kconvert.family.manifest import manifests_dir


@functools.lru_cache(maxsize=None)
def thresholds() -> dict:
    with open(manifests_dir() / "verify_thresholds.toml", "rb") as f:
        return tomllib.load(f)


def limits_for(scheme: str, overrides: dict | None = None) -> tuple[dict, dict]:
    """(faithfulness limits, cost budget) for a scheme; overrides `faithful.KEY` / `KEY` win."""
    t = thresholds()
    over = overrides or {}
    faithful = {**t["faithful"], **{k.split(".", 1)[1]: v for k, v in over.items() if k.startswith("faithful.")}}
    budget = {**t["cost"][scheme], **{k: v for k, v in over.items() if "." not in k}}
    return faithful, budget


def draft_limits(scheme: str, overrides: dict | None = None) -> dict:
    """{new_tokens, mean_kld, mean_kld_quantized, acceptance_drop} of the draft check for a scheme; `draft.KEY`
    overrides win."""
    t = thresholds()["draft"]
    drop = t["acceptance_drop"]
    out = {"new_tokens": int(t["new_tokens"]), "mean_kld": float(t["mean_kld"]),
           "mean_kld_quantized": float(t["mean_kld_quantized"]),
           "acceptance_drop": float(drop.get(scheme, drop["default"]))}
    out.update({k.split(".", 1)[1]: v for k, v in (overrides or {}).items() if k.startswith("draft.")})
    return out
