"""verify --per-layer: hidden-state error per layer against a reference, the first layer where a conversion
departs from its faithful reference, the layer adding the most quantization error, the vision tower's error."""

from __future__ import annotations

import math

FAULT_REL_ERROR = 1e-4  # hidden-state relative error vs the fake-quantized reference that marks a faulty layer
# DSA keeps the top-k keys of an indexer score: two correct fp32 implementations can decide a near-tie
# differently, which changes one position's attention in one layer. A layer whose new departures are that
# few (positions first over FAULT_REL_ERROR there) is not named as a fault; a damaged tensor moves far more.
ISOLATED_POSITIONS, ISOLATED_SHARE = 2, 0.002


def layer_curve(ref_meta, ref_tensors, got) -> list[dict]:
    """Relative hidden-state error per layer position (0 = embeddings, last = after the final norm), pooled
    over prompts, and how many token positions first depart (error over FAULT_REL_ERROR) there."""
    n = sum(1 for k in ref_tensors if k.startswith("prompt.0.hidden."))
    prompts = range(len(ref_meta["prompts"]))
    departed = {i: None for i in prompts}  # positions already over FAULT_REL_ERROR at an earlier layer
    curve = []
    for L in range(n):
        num = den = 0.0
        new = total = 0
        for i in prompts:
            r, g = ref_tensors[f"prompt.{i}.hidden.{L}"].float(), got[f"prompt.{i}.hidden.{L}"].float()
            num += float((g - r).pow(2).sum())
            den += float(r.pow(2).sum())
            d, rr = (g - r).reshape(r.shape[0], -1), r.reshape(r.shape[0], -1)  # [T, H] or [T, streams x H]
            per_pos = (d.pow(2).sum(-1) / rr.pow(2).sum(-1).clamp_min(1e-30)).sqrt()
            over = ~(per_pos <= FAULT_REL_ERROR)  # NaN counts as over
            new += int((over if departed[i] is None else over & ~departed[i]).sum())
            departed[i] = over if departed[i] is None else over | departed[i]
            total += per_pos.numel()
        curve.append({"position": L, "after": "embeddings" if L == 0 else f"layer {L - 1}" if L < n - 1 else
                      f"layer {L - 1} + final norm", "rel_error": (num / max(den, 1e-30)) ** 0.5,
                      "departed_positions": new, "positions": total})
    return curve


def largest_step(curve: list[dict]) -> int | None:
    """The decoder layer whose step adds the most error (position L + 1 is after layer L); in a clean
    quantized model that is where quantization costs the most; None when everything is exact."""
    errs = [c["rel_error"] for c in curve]
    if len(errs) < 2 or not max(errs) > 1e-4:
        return None
    return max(range(len(errs) - 1), key=lambda L: errs[L + 1] - errs[L])


def first_fault(curve: list[dict], vision: float | None) -> tuple[str | None, int | None]:
    """Where the conversion first departs from its faithful reference: ("layer N", N), ("embeddings", None),
    ("vision tower", None) or (None, None). A non-finite error is a fault too; a layer where only isolated
    positions depart (a DSA near-tie decided the other way) is not."""
    if vision is not None and not vision <= FAULT_REL_ERROR:
        return "vision tower", None
    for c in curve:
        isolated = c["departed_positions"] <= max(ISOLATED_POSITIONS, ISOLATED_SHARE * c["positions"])
        if not c["rel_error"] <= FAULT_REL_ERROR and not (math.isfinite(c["rel_error"]) and isolated):
            return (c["after"], None) if c["position"] == 0 else (f"layer {c['position'] - 1}", c["position"] - 1)
    return None, None


def vision_error(ref_tensors, got) -> float | None:
    vis = [(got[k].float(), ref_tensors[k].float()) for k in got if k.endswith(".vision") and k in ref_tensors]
    if not vis:
        return None
    return (sum(float((g - r).pow(2).sum()) for g, r in vis) / max(sum(float(r.pow(2).sum()) for _, r in vis), 1e-30)) ** 0.5
