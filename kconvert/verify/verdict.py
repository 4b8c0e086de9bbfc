"""`kconvert verify`: is a converted checkpoint faithful to its source?

1. integrity: every file's checksum (a damaged shard fails here, before any model runs);
2. the engine runs the reference's prompts on the conversion (all tp ranks);
3. llama.cpp-style statistics against the reference log-probs, overall and per prompt kind, and
   PASS / FAIL against the scheme's thresholds (manifests/verify_thresholds.toml);
4. with per_layer: hidden-state error after every layer (and the vision tower), the layer that
   adds the most error, and the tensors of that layer that cause it (verify_attribution).
"""

from __future__ import annotations

import functools
import json
import tempfile
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kconvert.verify import kld
from kconvert.converted.format import read_manifest, verify_files
from kconvert.errors import KConvertError, UsageError, VerifyFailed
from kconvert.family.manifest import manifests_dir
from kconvert.verify.reference import load_reference, run_reference
from kconvert.verify.run import load_result, run_all_ranks


@functools.lru_cache(maxsize=None)
def thresholds() -> dict:
    with open(manifests_dir() / "verify_thresholds.toml", "rb") as f:
        return tomllib.load(f)


@dataclass
class VerifyReport:
    out: str
    scheme: str
    tp: int
    verdict: str
    overall: dict
    by_kind: dict[str, dict]
    thresholds: dict
    failures: list[str] = field(default_factory=list)
    per_layer: list[dict] | None = None
    first_bad_layer: int | None = None
    vision_error: float | None = None
    attribution: list[dict] | None = None
    seconds: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)


def run_verify(out: str, *, reference: str | None = None, against: str | None = None, per_layer: bool = False,
               device: str = "cpu", force: bool = False, limits: dict | None = None, progress=None) -> VerifyReport:
    import time

    t0 = time.perf_counter()
    meta = read_manifest(out)
    if progress:
        progress("phase", name="integrity")
    try:
        verify_files(out)
    except KConvertError as e:
        raise VerifyFailed(f"integrity: {e.message}", file=e.file, tensor=e.tensor) from None
    with tempfile.TemporaryDirectory(prefix="kconvert-verify-") as tmp:
        if reference is None:
            if against is None:
                raise UsageError("give --reference REF.safetensors or --against SRC")
            if progress:
                progress("phase", name="reference")
            from kconvert.verify.prompts import prompts_for

            reference = str(Path(tmp) / "ref.safetensors")
            run_reference(against, reference, prompts_for(meta["config"]), hidden_states=per_layer)
        ref_meta, refs, ref_tensors = load_reference(reference)
        if ref_meta["source_fingerprint"] != meta["source"]["fingerprint"] and not force:
            raise UsageError(f"the reference was made from another source (fingerprint {ref_meta['source_fingerprint']}"
                             f" vs {meta['source']['fingerprint']}); pass --force to compare anyway", file=reference)
        if per_layer and "prompt.0.hidden.0" not in ref_tensors:
            raise UsageError("--per-layer needs a reference made with --hidden-states", file=reference)
        if progress:
            progress("phase", name="engine")
        result_path = str(Path(tmp) / "result.safetensors")
        tokens = [r.tokens for r in refs]
        layer_opts = {"source": against or meta["source"]["path"], "attribute_layer": None} if per_layer else None
        run_all_ranks(out, meta["layout"]["tp"], ref_meta["prompts"], tokens, result_path, layer_opts, device)
        got = load_result(result_path)
        report = _report(out, meta, ref_meta, refs, got, limits)
        if per_layer:
            _per_layer(report, ref_meta, ref_tensors, got)
            if report.first_bad_layer is not None and report.first_bad_layer < meta["config"].get(
                    "text_config", meta["config"])["num_hidden_layers"]:
                if progress:
                    progress("phase", name=f"attribution (layer {report.first_bad_layer})")
                layer_opts["attribute_layer"] = report.first_bad_layer
                run_all_ranks(out, meta["layout"]["tp"], ref_meta["prompts"], tokens, result_path, layer_opts, device)
                report.attribution = json.loads(Path(result_path + ".attribution.json").read_text())
    report.seconds = time.perf_counter() - t0
    return report


def _report(out, meta, ref_meta, refs, got, overrides: dict | None = None) -> VerifyReport:
    scheme = meta["quantization"]["scheme"]
    limits = {**thresholds()[scheme], **(overrides or {})}
    per_kind: dict[str, list] = {}
    for i, (p, r) in enumerate(zip(ref_meta["prompts"], refs)):
        stats = kld.compare(r, got[f"prompt.{i}.logprobs"])
        per_kind.setdefault(p["kind"], []).append(stats)
    overall = kld.summarize(kld.concat([s for v in per_kind.values() for s in v])).to_json()
    by_kind = {k: kld.summarize(kld.concat(v)).to_json() for k, v in per_kind.items()}
    failures = []
    if overall["mean_kld"] > limits["mean_kld"]:
        failures.append(f"mean KLD {overall['mean_kld']:.3g} > {limits['mean_kld']}")
    if overall["p99_kld"] > limits["p99_kld"]:
        failures.append(f"p99 KLD {overall['p99_kld']:.3g} > {limits['p99_kld']}")
    if overall["same_top1_pct"] < limits["same_top1_pct"]:
        failures.append(f"same top-1 {overall['same_top1_pct']:.1f} % < {limits['same_top1_pct']} %")
    return VerifyReport(out=str(out), scheme=scheme, tp=meta["layout"]["tp"], verdict="FAIL" if failures else "PASS",
                        overall=overall, by_kind=by_kind, thresholds=limits, failures=failures)


def _per_layer(report: VerifyReport, ref_meta, ref_tensors, got) -> None:
    """Relative hidden-state error per layer position (0 = embeddings, last = after the final norm),
    pooled over prompts, and the layer whose step adds the most error: where to look."""
    n = sum(1 for k in ref_tensors if k.startswith("prompt.0.hidden."))
    curve = []
    for L in range(n):
        num = den = 0.0
        for i in range(len(ref_meta["prompts"])):
            r, g = ref_tensors[f"prompt.{i}.hidden.{L}"].float(), got[f"prompt.{i}.hidden.{L}"].float()
            num += float((g - r).pow(2).sum())
            den += float(r.pow(2).sum())
        curve.append({"position": L, "after": "embeddings" if L == 0 else f"layer {L - 1}" if L < n - 1 else
                      f"layer {L - 1} + final norm", "rel_error": (num / max(den, 1e-30)) ** 0.5})
    report.per_layer = curve
    errs = [c["rel_error"] for c in curve]
    # the layer that adds the most error: damage shows as one step far above the others, and in a
    # clean quantized model it is where quantization costs the most (None when everything is exact)
    added = [errs[L + 1] - errs[L] for L in range(n - 1)]
    report.first_bad_layer = max(range(n - 1), key=lambda L: added[L]) if max(errs) > 1e-4 else None
    vis = [(got[k].float(), ref_tensors[k].float()) for k in got if k.endswith(".vision") and k in ref_tensors]
    if vis:
        report.vision_error = (sum(float((g - r).pow(2).sum()) for g, r in vis) /
                               max(sum(float(r.pow(2).sum()) for _, r in vis), 1e-30)) ** 0.5
