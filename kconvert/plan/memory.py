"""`kconvert plan`: what each rank holds after conversion, and whether it fits an accelerator.

From config.json and safetensors headers only (never weights). SRC is a checkpoint (local directory
or Hub repo id: real shapes and dtypes), or a config.json alone (a directory holding only it, the
file itself, or the name of a bundled example under manifests/examples/): shapes then come from the
family manifest, the source is taken as bf16 (float32 for `e_score_correction_bias`).

Memory model, per rank (every number in bytes; GiB = 2**30):
  usable      = mem_fraction x device memory. Default 0.92: allocators fragment and runtimes keep
                pools of their own (vLLM's --gpu-memory-utilization defaults to 0.9 for this reason).
  reserve     = activations and workspace, `default_reserve`: 2 GiB of runtime (CUDA/MUSA context,
                NCCL/MCCL buffers, CUDA graphs) + one 8192-token prefill chunk x hidden_size x 2 bytes
                x 24 live activation buffers (residual, norms, q/kv/o projections, MoE dispatch and
                combine, double-buffered). 4.6 GiB at hidden 7168. --reserve-gb replaces it.
  weights     = the largest rank's converted bytes: `layout.pieces` gives each rank's slice and
                `QuantPolicy.stored_bytes` its size (scales included). MTP layers are left out (the
                converter drops them by default). Replicated tensors count on every rank.
  KV cache    = batch x context x KV bytes per token per rank (kv_bytes.py; replicated across tp).
  fits        = weights + reserve + KV cache <= usable
  max context = floor((usable - weights - reserve) / (batch x KV bytes per token))
  KV options  = the same for bf16 and fp8, and the context the host tier reaches with --host-gb of host
                memory per rank (kv_bytes.kv_options: indexer keys + 1/8 of the latent on the device).
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from kconvert import renamed
from kconvert.source.checkpoint import INDEX, SINGLE, Checkpoint
from kconvert.errors import CheckpointError, UsageError
from kconvert.io.gc_pause import keep_to_exit
from kconvert.io.side_files import MAX_CONFIG, read_json
from kconvert.plan.device_presets import GIB, DevicePreset, auto_quant, devices, find_device
from kconvert.plan.fit import MEM_FRACTION, Sizing, capped, default_reserve, fit  # noqa: F401 (default_reserve, fit: API)
from kconvert.plan.kv_bytes import kv_bytes, kv_options
from kconvert.plan.pipeline import GPUS_PER_NODE, pipeline_fit, search, stage_inputs
from kconvert.plan.rank_bytes import COMPONENTS, checkpoint_groups, config_groups
from kconvert.convert.layout import TP_DEGREES, Layout, check
from kconvert.source.stored_quant import source_fp8_block
from kconvert.family.manifest import ModelMap, manifests_dir
from kconvert.quant.policy import QuantPolicy


# ---------------------------------------------------------------------------------------------- the plan
@dataclass
class Plan:
    source: str
    source_kind: str  # checkpoint | config
    family: str
    model: dict
    params: dict[str, int]
    total_params: int
    layout: dict
    quant: str
    converted_bytes: int  # the whole converted model once (MTP left out)
    replicated_bytes: int  # per rank: tensors every rank holds whole
    rank: dict  # the largest rank: index, bytes by component, total; smallest rank's total
    kv_cache: dict
    memory: dict  # the chosen device at --context / --batch
    devices: list[dict]  # the same rank on every preset
    tp_table: list[dict]
    kv_options: list[dict] = field(default_factory=list)  # bf16 / fp8 / host tier on the chosen device
    pipeline: dict | None = None  # --pp > 1: every stage on the chosen device (pipeline.pipeline_fit)
    pp_search: dict | None = None  # the smallest pp per tp degree that fits the chosen device (pipeline.search)
    warnings: list[str] = field(default_factory=list)
    quant_reason: str | None = None  # --quant auto: why this format for this device

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def _open(src: str, revision: str | None):
    """(source kind, ModelMap, groups) for SRC."""
    p = Path(src)
    example = manifests_dir() / "examples" / renamed.current(renamed.EXAMPLES, src) / "config.json"
    if not p.exists() and "/" not in src and example.is_file():
        p = example
    if p.is_dir() and not ((p / INDEX).exists() or (p / SINGLE).exists()) and (p / "config.json").is_file():
        p = p / "config.json"
    if p.is_file():
        config = read_json(p, limit=MAX_CONFIG)
        if not isinstance(config, dict):
            raise CheckpointError("config.json is not a JSON object", file=str(p))
        model, groups = config_groups(json.dumps(config, sort_keys=True), str(p))
        return "config", model, groups
    ck = Checkpoint.open(src, revision=revision, headers_only=True)
    keep_to_exit(ck)  # a console run ends without freeing its 500k+ entries one by one (io/gc_pause.py)
    return "checkpoint", ck.model, tuple(checkpoint_groups(ck))


def _tp_table(sz: Sizing, model: ModelMap, layout: Layout, dev: DevicePreset) -> list[dict]:
    """Each degree of TP_DEGREES in the same expert mode (ep = tp, or the same ep): does it divide, fit?"""
    table = []
    for t in TP_DEGREES:
        e = t if layout.ep == layout.tp else layout.ep
        row = {"tp": t, "ep": e, "ok": False, "reason": None, "weights_per_rank": None, "fits": False,
               "headroom_bytes": None, "max_context": None, "fp8_misaligned": None}
        table.append(row)
        if t % e:
            row["reason"] = f"--ep {e} does not divide tp {t}"
            continue
        lay = Layout.make(t, e)
        row["reason"] = sz.problem(lay)
        if row["reason"]:
            continue
        w = max(sum(r.values()) for r in sz.per_rank(lay))
        f = sz.fit(dev, w, t)
        row.update(ok=True, weights_per_rank=w, fits=f["fits"], headroom_bytes=f["headroom_bytes"],
                   max_context=f["max_context"], fp8_misaligned=sz.misaligned(lay))
    return table


def _warnings(sz: Sizing, layout: Layout, dev: DevicePreset, max_pos: int) -> list[str]:
    out = []
    if max_pos and sz.context > max_pos:
        out.append(f"--context {sz.context} is beyond the model's max_position_embeddings ({max_pos}): "
                   "memory is computed, but the model was not trained for it")
    misaligned = sz.misaligned(layout)
    if misaligned:
        b = sz.policy.fp8_block
        out.append(f"--tp {layout.tp} --ep {layout.ep} --quant fp8: {misaligned}: {b}x{b} scale blocks "
                   "straddle ranks, so a block-FP8 source is not resharded losslessly and engines that need "
                   "aligned slices (vLLM's block-FP8 linear) refuse it")
    if sz.policy.scheme == "fp8" and not dev.fp8:
        out.append(f"{dev.key} has no native FP8: fp8 weights take the memory shown but need a weight-only "
                   "(dequantizing) kernel there")
    if sz.policy.scheme == "fp4" and "fp4" not in dev.formats:
        out.append(f"{dev.key} has no FP4 kernels: --quant fp8 re-encodes FP4 experts exactly for it "
                   "(or plan with --quant auto)")
    if sz.policy.scheme == "nvfp4" and "nvfp4" not in dev.formats:
        out.append(f"{dev.key} has no NVFP4 tensor cores: NVFP4 weights fit the memory shown but run through a "
                   "weight-only (dequantizing) kernel there (or plan with --quant auto)")
    if sz.kv.dtype == "fp8" and not dev.fp8:
        out.append(f"{dev.key} has no native FP8: an fp8 KV cache may not be supported by its attention kernels")
    return out


AUTO = "auto"  # plan --quant auto: the device preset's choice (device_presets.auto_quant)


def _binding(pipe: dict) -> dict:
    return pipe["stages"][pipe["binding_stage"]]


def make_plan(src: str, tp: int, ep: int | None = None, quant: str = "none", device: str = "H200",
              context: int | None = None, batch: int = 1, kv_dtype: str = "bf16", reserve_gb: float | None = None,
              mem_fraction: float = MEM_FRACTION, revision: str | None = None, host_gb: float = 256.0,
              pp: int = 1, pp_layers: str | None = None, gpus_per_node: int = GPUS_PER_NODE) -> Plan:
    """Plan SRC converted for `--tp tp --ep ep --pp pp --quant quant` on `device` (see the module docstring;
    stages and the (tp, pp) search: pipeline.py)."""
    dev = find_device(device)
    layout = Layout.make(tp, ep)
    if batch < 1 or (context is not None and context < 1):
        raise UsageError("--batch and --context must be at least 1")
    if not 0 < mem_fraction <= 1:
        raise UsageError(f"--mem-fraction {mem_fraction} must be in (0, 1]")
    if gpus_per_node < 1:
        raise UsageError(f"--gpus-per-node {gpus_per_node} must be at least 1")
    kind, model, groups = _open(src, revision)
    tc = model.text_config
    reason = None
    if quant == AUTO:  # the device preset says which formats its kernels run
        quant, reason = auto_quant(dev, tc, model.config, model.family)
    qc = model.config.get("quantization_config") or tc.get("quantization_config") or {}
    # a 32 x 32 FP8 source keeps its blocks; the family's traits say what nvfp4 does with each role
    policy = QuantPolicy(quant, fp8_block=source_fp8_block(qc), family=model.family)
    max_pos = int(tc.get("max_position_embeddings") or 0)
    reserve = int(reserve_gb * GIB) if reserve_gb is not None else default_reserve(int(tc["hidden_size"]))
    sz = Sizing(groups, policy, model.text.expert_count, kv_bytes(tc, kv_dtype), reserve,
                 context or max_pos or 4096, batch, mem_fraction, model, max_pos)
    check(model, layout, sz.problem)  # the one-line error naming the tp degrees that work

    per_rank = sz.per_rank(layout)
    totals = [sum(r.values()) for r in per_rank]
    top = max(range(layout.tp), key=totals.__getitem__)
    params: dict[str, int] = defaultdict(int)
    for g in groups:
        params[g.info.component] += g.numel
    stored = [(g, policy.stored_bytes(g.info, g.shape, g.itemsize) * g.count) for g in groups]
    vision = next((p for p in model.parts if p.group == "vision"), None)
    pipe = None
    mem = sz.fit(dev, totals[top], layout.tp)
    dev_fits = [sz.fit(d, totals[top], layout.tp) for d in devices().values()]
    kv_layers = model.text.layer_count
    if pp > 1 or pp_layers is not None:  # per device, the stage with the least headroom decides
        inputs = stage_inputs(sz, model, layout)
        pipe = pipeline_fit(sz, inputs, layout, pp, dev, pp_layers, gpus_per_node)
        mem = _binding(pipe)
        kv_layers = mem["layer_count"]
        dev_fits = [_binding(pipeline_fit(sz, inputs, layout, pp, d, pp_layers)) for d in devices().values()]
    kv_free = mem["headroom_bytes"] + mem["kv_bytes"]  # usable - weights - reserve
    return Plan(
        source=src, source_kind=kind, family=model.name,
        model={"layers": model.text.layer_count, "hidden_size": tc.get("hidden_size"),
               "attention_heads": tc.get("num_attention_heads"), "routed_experts": sz.n_experts,
               "experts_per_token": model.text.experts_per_token, "kv_lora_rank": tc.get("kv_lora_rank"),
               "qk_rope_head_dim": tc.get("qk_rope_head_dim"),
               "index_head_dim": tc.get("index_head_dim") if tc.get("index_topk") else None,
               "max_position_embeddings": max_pos or None, "vision_layers": vision.layer_count if vision else 0},
        params={c: params[c] for c in COMPONENTS if params.get(c)},
        total_params=sum(v for c, v in params.items() if c != "mtp"),  # as models are counted: draft heads apart
        layout={"tp": layout.tp, "ep": layout.ep, "expert_tp": layout.expert_tp}, quant=quant,
        converted_bytes=sum(b for _, b in stored),
        replicated_bytes=sum(b for g, b in stored if g.info.split == "replicate"),
        rank={"index": top, "bytes": per_rank[top], "total": totals[top], "min_total": min(totals)},
        kv_cache=sz.kv.on_tp(layout.tp).to_json(),
        memory={**mem, "context": sz.context, "batch": batch, "mem_fraction": mem_fraction,
                "reserve_default": reserve_gb is None},
        devices=[{**f, "fp8": d.fp8, "backend": d.backend, "bandwidth_tbs": d.bandwidth_tbs}
                 for f, d in zip(dev_fits, devices().values())],
        tp_table=_tp_table(sz, model, layout, dev),
        kv_options=[{**o, "max_context": capped(o["max_context"], max_pos),
                     "tiered_max_context": capped(o["tiered_max_context"], max_pos)}
                    for o in kv_options({**tc, "num_hidden_layers": kv_layers}, kv_free, batch, int(host_gb * GIB),
                                        layout.tp)],
        pipeline=pipe, pp_search=search(sz, model, layout, dev, gpus_per_node),
        warnings=_warnings(sz, layout, dev, max_pos), quant_reason=reason,
    )
