"""`kconvert serve-check OUT` (and `export --check vllm`): an export as vLLM itself loads it and runs it.

- `load_check`: vLLM builds its own model class for the export on the CPU and loads it with its own loader
  (driver.py's `load` job, in the vLLM environment); every stored weight, dequantized from the parameters vLLM holds
  (the dtype vLLM chose for each scale included), is compared with kconvert's dequantization of the same tensor
  (source/formats.py). Per tensor kind (the manifest's component): found (loaded and compared), missing (vLLM
  parameters no stored tensor filled), unexpected (stored tensors vLLM's model has no place for), the largest
  difference as loaded. Draft layers (component `mtp`) are not part of vLLM's target model (its MTP model loads
  them) and are counted apart. PASS: nothing missing or unexpected, every difference within `atol` (0: exact).
- `run_check`: vLLM's prompt log-probs on the reference's own token lists (driver.py's `logprobs` job) against a
  `kconvert reference` file, with verify's statistics (kld.py).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kconvert.io.workdir import work_dir
from kconvert.source.checkpoint import Checkpoint
from kconvert.verify.kld import Summary, compare, concat, summarize
from kconvert.verify.reference import load_reference
from kconvert.verify.vllm_check.env import run_job

DRAFT = "mtp"  # the manifest's component of draft layers


@dataclass
class KindRow:
    kind: str
    found: int = 0
    unexpected: int = 0
    draft: int = 0  # draft layers vLLM's target model leaves to its MTP model
    max_error: float = 0.0
    worst: str = ""  # the tensor with the largest difference


@dataclass
class LoadCheck:
    export: str
    vllm: str
    dtype: str
    refused: str = ""  # vLLM's own error line where it could not build or load the export
    model_class: str = ""
    rows: list[KindRow] = field(default_factory=list)
    missing: dict[str, list[int]] = field(default_factory=dict)  # vLLM parameter -> [cells no tensor filled, cells]
    unexpected: list[str] = field(default_factory=list)  # stored tensors vLLM's model has no place for (not drafts)
    errors: dict[str, float] = field(default_factory=dict)  # stored weight -> largest |vLLM as loaded - kconvert| > 0
    kernels_claimed: list[str] = field(default_factory=list)  # what construction was lent (load only, no forward)
    atol: float = 0.0

    @property
    def passed(self) -> bool:
        return not self.refused and not self.missing and not self.unexpected and \
            all(r.max_error <= self.atol for r in self.rows)

    def to_json(self) -> dict:
        return {**asdict(self), "passed": self.passed,
                "rows": [{**asdict(r), "max_error": _finite(r.max_error)} for r in self.rows],
                "errors": {k: _finite(v) for k, v in self.errors.items()}}


def _finite(x: float):
    return x if math.isfinite(x) else "inf"


def default_dtype(ck: Checkpoint) -> str:
    """vLLM's model dtype for a check: float32 unquantized (every weight as stored), bfloat16 quantized (vLLM's FP8
    layers take no float32)."""
    return "bfloat16" if ck.quantization_config else "float32"


def load_check(export: str | Path, *, dtype: str | None = None, atol: float = 0.0, timeout: int = 1800) -> LoadCheck:
    """Load `export` in vLLM's own model class and compare every loaded weight with kconvert's reading of it."""
    return load_checks([export], dtype=dtype, atol=atol, timeout=timeout)[0]


def load_checks(exports: list, *, dtype: str | None = None, atol: float = 0.0, timeout: int = 1800) -> list[LoadCheck]:
    """`load_check` of several exports in one vLLM process (vLLM is imported once)."""
    from safetensors.torch import load_file

    cks = [Checkpoint.open(e) for e in exports]
    dtypes = [dtype or default_dtype(ck) for ck in cks]
    with work_dir("kconvert-vllm") as tmp:
        items = [{"export": str(ck.root), "out": str(tmp / f"out{i}"), "dtype": d} for i, (ck, d) in enumerate(zip(cks, dtypes))]
        results, version = run_job("load", items, tmp, timeout=timeout)
        loaded = [load_file(str(tmp / f"out{i}" / "loaded.safetensors")) if "error" not in r else None
                  for i, r in enumerate(results)]
    return [compare_loaded(ck, r, w, version, d, atol) for ck, r, w, d in zip(cks, results, loaded, dtypes)]


def compare_loaded(ck: Checkpoint, result: dict, loaded: dict | None, version: str, dtype: str, atol: float) -> LoadCheck:
    """One export's LoadCheck from the driver's result and the weights it wrote."""
    check = LoadCheck(str(ck.root), version, dtype, refused=result.get("error", ""), atol=atol)
    if check.refused:
        return check
    took = set(result["loaded"])
    rows: dict[str, KindRow] = {}
    for name, t in ck.logical.items():
        kind = ck.info(name).component
        row = rows.setdefault(kind, KindRow(kind))
        if t.main.name not in took:
            if kind == DRAFT:
                row.draft += 1
            else:
                row.unexpected += 1
                check.unexpected.append(name)
            continue
        got, want = loaded.get(name), ck.read(name, dtype=torch.float32)
        err = math.inf if got is None or got.shape != want.shape else \
            float((got - want).abs().max()) if got.numel() else 0.0
        row.found += 1
        if not err == 0:
            check.errors[name] = err
        if not err <= row.max_error:
            row.max_error, row.worst = err, name
    check.model_class, check.rows = result["model_class"], sorted(rows.values(), key=lambda r: r.kind)
    check.missing, check.kernels_claimed = result["unfilled"], result.get("kernels_claimed", [])
    return check


@dataclass
class RunCheck:
    export: str
    vllm: str
    dtype: str
    summary: Summary | None = None
    refused: str = ""

    def to_json(self) -> dict:
        return {"export": self.export, "vllm": self.vllm, "dtype": self.dtype, "refused": self.refused,
                **(self.summary.to_json() if self.summary else {})}


def run_check(export: str | Path, reference: str | Path, *, dtype: str | None = None, timeout: int = 1800) -> RunCheck:
    """vLLM's next-token log-probs on every prompt of `reference` (a `kconvert reference` file with full log-probs),
    compared position by position (mean KL, top-1, ...). `dtype`: as `load_check`'s."""
    return run_checks([(export, reference)], dtype=dtype, timeout=timeout)[0]


def run_checks(pairs: list, *, dtype: str | None = None, timeout: int = 1800, extra: list | None = None) -> list[RunCheck]:
    """`run_check` of several (export, reference) pairs in one vLLM process; `extra`: per pair, more of the driver's
    item keys (`custom_ops`: vLLM's own compiled ops, which the check turns off where they are wrong)."""
    from safetensors.torch import load_file, save_file

    refs = [load_reference(ref)[1] for _, ref in pairs]
    dtypes = [dtype or default_dtype(Checkpoint.open(export, headers_only=True)) for export, _ in pairs]
    with work_dir("kconvert-vllm") as tmp:
        items = []
        for i, ((export, _), ref) in enumerate(zip(pairs, refs)):
            save_file({f"prompt.{j}.tokens": r.tokens.contiguous() for j, r in enumerate(ref)},
                      str(tmp / f"tokens{i}.safetensors"))
            items.append({"export": str(Path(export).resolve()), "tokens": str(tmp / f"tokens{i}.safetensors"),
                          "out": str(tmp / f"logprobs{i}.safetensors"), "dtype": dtypes[i], **((extra or {})[i] if
                                                                                                 extra else {})})
        results, version = run_job("logprobs", items, tmp, timeout=timeout)
        got = [load_file(it["out"]) if "error" not in r else None for it, r in zip(items, results)]
    out = []
    for (export, _), ref, r, lp, d in zip(pairs, refs, results, got, dtypes):
        if lp is None:
            out.append(RunCheck(str(export), version, d, refused=r["error"]))
            continue
        stats = concat([compare(p, lp[f"prompt.{j}.logprobs"]) for j, p in enumerate(ref)])
        out.append(RunCheck(str(export), version, d, summarize(stats)))
    return out


def vllm_configs(items: list[tuple[str | Path, list[str]]], *, timeout: int = 600) -> list[dict]:
    """vLLM's own config object for each (checkpoint directory, attribute names): {"class", "text_class",
    "architectures", "attributes": {name: {"value": V} | {"absent": True}}}, or {"error": LINE} where vLLM refuses
    the config.json."""
    with work_dir("kconvert-vllm") as tmp:
        results, _ = run_job("config", [{"export": str(Path(d).resolve()), "attributes": list(a)} for d, a in items],
                             tmp, timeout=timeout)
    return results
