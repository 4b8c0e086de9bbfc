"""`kconvert verify`: is a converted checkpoint faithful to its scheme, and what does the scheme cost?

1. integrity: every file's checksum (a damaged shard fails here, before any model runs);
2. the engine runs the reference's prompts on the conversion (all tp ranks);
3. faithfulness: statistics against a reference run of the source whose weights were fake-quantized
   with the conversion's own scheme by an independent implementation (verify/fake_quant.py). A
   faithful conversion agrees to fp32 round-off; any slicing, scale, placement or engine fault FAILs,
   however small next to the quantization noise ("the conversion is wrong");
4. cost: llama.cpp-style statistics against the unquantized reference, overall and per prompt kind,
   against the scheme's budget (manifests/verify_thresholds.toml; "the scheme is too lossy for this model");
5. draft heads (a conversion that holds them): each head's predictions against the reference's and its
   acceptance in greedy speculative decoding against the source head's own (verify/draft.py);
6. with per_layer: hidden-state error after every layer for both, the first layer where the
   faithfulness error appears (`first_fault_layer`), the layer that adds the most quantization error
   (`largest_error_step_layer`), and the tensors of the faulty layer that cause it (attribution).

JSON (VerifyReport.to_json): verdict, scheme, tp, failures, faithfulness {verdict, reference, overall,
by_kind, limits, failures, per_layer, first_fault_layer}, cost {verdict, overall, by_kind, limits,
failures, per_layer, largest_error_step_layer}, draft {verdict, reference, heads, limits, failures},
vision_error, attribution, seconds.
"""

from __future__ import annotations

import json
import math
from kconvert.io.workdir import compiler_caches, unnamed, work_dir
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kconvert.disk_format.catalog import Catalog
from kconvert.disk_format.integrity import verify_files
from kconvert.errors import KConvertError, UsageError, VerifyFailed
from kconvert.verify import kld
from kconvert.verify.reference import load_reference, run_reference
from kconvert.verify.layer_error import first_fault, largest_step, layer_curve, vision_error
from kconvert.verify.run import load_result, run_all_ranks
from kconvert.verify.thresholds import draft_limits, limits_for, thresholds  # noqa: F401 (thresholds: read here by tests)

WRONG = "the conversion is wrong"
LOSSY = "the scheme is too lossy for this model"
CHECKED = ("mean_kld", "p99_kld", "same_top1_pct", "ppl_ratio")
KIND_FACTOR = 2.0  # every prompt kind's mean KLD must stay within this multiple of the budget (fewer positions)


@dataclass
class Check:
    """One of verify's two questions answered: statistics, limits and what broke them."""

    verdict: str  # PASS | FAIL | SKIPPED
    reference: str
    overall: dict = field(default_factory=dict)
    by_kind: dict[str, dict] = field(default_factory=dict)
    limits: dict = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    per_layer: list[dict] | None = None


@dataclass
class VerifyReport:
    out: str
    scheme: str
    tp: int
    verdict: str
    faithfulness: Check
    cost: Check
    failures: list[str] = field(default_factory=list)
    pp: int = 1
    first_fault_layer: int | None = None  # first decoder layer whose output departs from the faithful reference
    fault_at: str | None = None  # "embeddings", "layer N", "vision tower" or None
    largest_error_step_layer: int | None = None  # the layer that adds the most error vs the unquantized reference
    vision_error: float | None = None
    attribution: list[dict] | None = None
    draft: object | None = None  # verify/draft.DraftCheck of a conversion that holds draft heads
    # the conversion's exact casts per tensor kind (kconvert.json: nvfp4 from MXFP4): {"exact", "data_derived"} blocks;
    # the faithfulness check holds every cast tensor to the source's own values, so a claimed exact block is checked
    exact_casts: dict | None = None
    seconds: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)


def failed_limits(summary: dict, limits: dict) -> list[str]:
    """Which limits a summary breaks; any non-finite statistic is a failure (NaN compares false)."""
    out = [f"{k} is {summary[k]}" for k in ("mean_kld", "p99_kld", "max_kld", "same_top1_pct", "ppl_ratio")
           if k in summary and not math.isfinite(summary[k])]
    if out:
        return out
    for k in CHECKED:
        if k not in limits:
            continue
        if k == "same_top1_pct" and summary[k] < limits[k]:
            out.append(f"same top-1 {summary[k]:.2f} % < {limits[k]} %")
        elif k == "ppl_ratio" and abs(math.log(summary[k])) > math.log(limits[k]):
            out.append(f"PPL ratio {summary[k]:.4f} outside 1/{limits[k]}..{limits[k]}")
        elif k not in ("same_top1_pct", "ppl_ratio") and summary[k] > limits[k]:
            out.append(f"{k.replace('_kld', ' KLD')} {summary[k]:.3g} > {limits[k]}")
    return out


def compare(prompts: list[dict], refs: list, got: dict, limits: dict, reference: str, per_kind_limits: bool) -> Check:
    """Statistics of the engine's log-probs against `refs`, overall and by prompt kind, checked against limits."""
    per_kind: dict[str, list] = {}
    for i, (p, r) in enumerate(zip(prompts, refs)):
        per_kind.setdefault(p["kind"], []).append(kld.compare(r, got[f"prompt.{i}.logprobs"]))
    overall = kld.summarize(kld.concat([s for v in per_kind.values() for s in v])).to_json()
    by_kind = {k: kld.summarize(kld.concat(v)).to_json() for k, v in per_kind.items()}
    failures = failed_limits(overall, limits)
    if per_kind_limits:  # a budget holds for every kind of prompt, not only on average
        kind_limits = {k: KIND_FACTOR * v for k, v in limits.items() if k == "mean_kld"}
        failures += [f"{kind}: {f}" for kind, row in by_kind.items() for f in failed_limits(row, kind_limits)]
    return Check("FAIL" if failures else "PASS", reference, overall, by_kind, limits, failures)


def run_verify(out: str, *, reference: str | None = None, faithful_reference: str | None = None,
               against: str | None = None, per_layer: bool = False, device: str = "cpu", force: bool = False,
               limits: dict | None = None, progress=None, kv: tuple | None = None, export=None) -> VerifyReport:
    """`export` (verify/exported.Export): OUT is its temporary conversion, judged as the export's format."""
    import time

    t0 = time.perf_counter()
    meta = Catalog.read(out).whole_doc()

    def phase(name: str, prompts: int | None = None):
        """Name the step on the bar; with `prompts`, count them from 0 (returns the callback to pass on)."""
        if progress:
            progress("phase", name=name)
            if prompts is not None:
                progress("start", total=prompts, restart=True)
        return progress
    phase("integrity")
    try:
        verify_files(out)
    except KConvertError as e:
        raise VerifyFailed(f"integrity: {e.message}", file=e.file, tensor=e.tensor) from None
    # removed on every way out, the compilers' caches inside it, never named by a message (kconvert/io/workdir.py)
    with work_dir("verify") as tmp, compiler_caches(Path(tmp)), unnamed(Path(tmp), "verify (in its temporary work)"):
        if reference is None:
            if against is None:
                raise UsageError("give --reference REF.safetensors or --against SRC")
            from kconvert.verify.prompts import prompts_for

            reference, prompts = str(Path(tmp) / "ref.safetensors"), prompts_for(meta["config"])
            run_reference(against, reference, prompts, hidden_states=per_layer,
                          progress=phase("reference (unquantized source)", len(prompts)))
        ref_meta, refs, ref_tensors = load_reference(reference)
        made_from = export.made_from if export else meta["source"]["fingerprint"]
        _check_reference(reference, ref_meta, ref_tensors, made_from, force, per_layer)
        fq = _faithful_reference(out, meta, reference, ref_meta, refs, ref_tensors, faithful_reference, against,
                                 per_layer, force, Path(tmp), phase, export)
        result_path = str(Path(tmp) / "result.safetensors")
        tokens = [r.tokens for r in refs]
        source = against or meta["source"]["path"]
        layer_opts = {"source": source, "attribute_layer": None} if per_layer else None
        world = meta["layout"]["tp"] * meta["layout"].get("pp", 1)  # every rank of the tp x pp layout
        tick = phase(f"engine on {world} rank{'s' * (world > 1)}", len(tokens))
        draft = _draft_options(meta, export, limits)
        run_all_ranks(out, world, ref_meta["prompts"], tokens, result_path, layer_opts, device, kv, progress=tick,
                      draft=draft)
        got = load_result(result_path)
        report = _report(out, meta, ref_meta, refs, got, fq, limits, export)
        if draft:
            _check_draft(report, meta, ref_meta, tokens, got, against, draft, Path(tmp), phase)
        if per_layer:
            report.cost.per_layer = layer_curve(ref_meta, ref_tensors, got)
            report.largest_error_step_layer = largest_step(report.cost.per_layer)
            report.vision_error = vision_error(ref_tensors, got)
            if fq is not None:
                report.faithfulness.per_layer = layer_curve(ref_meta, fq[2], got)
                report.fault_at, report.first_fault_layer = first_fault(report.faithfulness.per_layer,
                                                                        vision_error(fq[2], got))
            n_layers = meta["config"].get("text_config", meta["config"])["num_hidden_layers"]
            # attribute only a real fault in a decoder layer (not the embeddings, the vision tower or noise)
            if report.first_fault_layer is not None and 0 <= report.first_fault_layer < n_layers:
                phase(f"attribution (layer {report.first_fault_layer})")
                layer_opts["attribute_layer"] = report.first_fault_layer
                run_all_ranks(out, world, ref_meta["prompts"], tokens, result_path, layer_opts, device, kv)
                report.attribution = json.loads(Path(result_path + ".attribution.json").read_text())
    report.seconds = time.perf_counter() - t0
    return report


def _draft_options(meta: dict, export, overrides: dict | None) -> dict | None:
    """The draft check's options when OUT holds draft heads (an export's are not checked)."""
    from kconvert.verify.draft import draft_layers

    if export is not None or not draft_layers(meta):
        return None
    return draft_limits(meta["quantization"]["scheme"], overrides)


def _check_draft(report: VerifyReport, meta, ref_meta, tokens, got, against, limits: dict, tmp: Path, phase) -> None:
    """The draft heads' check (verify/draft.py) into the report: the source's own head as the reference."""
    from kconvert.verify import draft
    from kconvert.verify.fake_quant import planned_slices

    src = against or meta["source"]["path"]
    ref, label = None, "no source checkpoint at hand (pass --against SRC)"
    if against is not None or (src and Path(src).exists()):
        phase("draft heads: the source's own head")
        label, ref = draft.reference_draft(src, ref_meta["prompts"], tokens, limits["new_tokens"], tmp)
    copied = all(e["transform"] == "copy" for e in planned_slices(meta).values())
    report.draft = draft.check(meta, ref_meta["prompts"], tokens, got, ref, label, copied, limits)
    if report.draft.failures:
        report.failures.append("draft heads: " + "; ".join(report.draft.failures))
        report.verdict = "FAIL"


def _check_reference(path, ref_meta, ref_tensors, made_from: str | None, force: bool, per_layer: bool) -> None:
    """made_from: the source fingerprint OUT records; None (an export kconvert did not make): taken on trust."""
    if ref_meta.get("fake_quant"):
        raise UsageError("--reference must be a reference of the unquantized source (this one is fake-quantized: "
                         "pass it as --faithful-reference)", file=path)
    if made_from is not None and ref_meta["source_fingerprint"] != made_from and not force:
        raise UsageError(f"the reference was made from another source (fingerprint {ref_meta['source_fingerprint']}"
                         f" vs {made_from}); pass --force to compare anyway", file=path)
    if per_layer and "prompt.0.hidden.0" not in ref_tensors:
        raise UsageError("--per-layer needs a reference made with --hidden-states", file=path)


def _faithful_reference(out, meta, reference, ref_meta, refs, ref_tensors, path, against, per_layer, force, tmp: Path,
                        phase, export=None):
    """(label, per-prompt log-probs, tensors) of the fake-quantized reference, or None when no source is at hand.
    For an export: its source (--against, else the path it records) under its rule and stored scales."""
    from kconvert.verify.fake_quant import plan_digest, planned_slices

    if path is None and (export is None or export.format == "none") and all(
            e["transform"] == "copy" for e in planned_slices(meta).values()):
        return "the unquantized reference (every weight is copied)", refs, ref_tensors
    if path is None:
        src = against or (export.source if export else meta["source"]["path"])
        if against is None and not (src and Path(src).exists()):  # a Hub id or a moved source: say so, don't guess
            return None
        path = str(tmp / "faithful.safetensors")
        run_reference(src, path, ref_meta["prompts"], hidden_states=per_layer, like=out,
                      like_export=export.path if export else None,
                      progress=phase("faithfulness reference (fake-quantized source)", len(ref_meta["prompts"])))
        label = f"{src} fake-quantized as " + (f"{export.format} with the export's scales" if export else meta['quantization']['scheme'])
    else:
        label = path
    fq_meta, fq_refs, fq_tensors = load_reference(path)
    fake = fq_meta.get("fake_quant") or {}
    if fake.get("plan_digest") != plan_digest(meta, of_export=export is not None) and not force:
        raise UsageError("the faithfulness reference was made for another conversion (scheme, layout or slices "
                         "differ); make it with `kconvert reference SRC --like OUT`", file=path)
    if any(not torch.equal(a.tokens, b.tokens) for a, b in zip(refs, fq_refs)) or len(refs) != len(fq_refs):
        raise UsageError("the faithfulness reference ran other prompts than --reference", file=path)
    if per_layer and "prompt.0.hidden.0" not in fq_tensors:
        raise UsageError("--per-layer needs a faithfulness reference made with --hidden-states", file=path)
    return label, fq_refs, fq_tensors


def _report(out, meta, ref_meta, refs, got, fq, overrides: dict | None = None, export=None) -> VerifyReport:
    scheme = export.format if export else meta["quantization"]["scheme"]
    faithful_limits, budget = limits_for(export.budget if export else scheme, overrides)
    prompts = ref_meta["prompts"]
    if fq is None:
        faith = Check("SKIPPED", "no source checkpoint at hand (pass --against SRC or --faithful-reference)",
                      limits=faithful_limits)
    else:
        faith = compare(prompts, fq[1], got, faithful_limits, fq[0], per_kind_limits=False)
    cost = compare(prompts, refs, got, budget, "the unquantized source", per_kind_limits=True)
    failures = ([f"{WRONG}: " + "; ".join(faith.failures)] if faith.failures else []) + \
        ([f"{LOSSY} ({scheme} budget): " + "; ".join(cost.failures)] if cost.failures else [])
    return VerifyReport(out=str(out), scheme=scheme, tp=meta["layout"]["tp"], pp=meta["layout"].get("pp", 1),
                        verdict="FAIL" if failures else "PASS", faithfulness=faith, cost=cost, failures=failures,
                        exact_casts=meta["quantization"].get("exact_casts"))
