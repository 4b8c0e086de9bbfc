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
  KV cache    = batch x context x KV bytes per token per rank (kv_cache.py; replicated across tp).
  fits        = weights + reserve + KV cache <= usable
  max context = floor((usable - weights - reserve) / (batch x KV bytes per token))
"""

from __future__ import annotations

import functools
import json
import tomllib
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from kconvert.source.checkpoint import INDEX, SINGLE, Checkpoint
from kconvert.errors import CheckpointError, ManifestError, UsageError
from kconvert.plan.kv_bytes import KVCache, kv_cache
from kconvert.convert.layout import Layout, check, pieces
from kconvert.family.manifest import ModelMap, TensorInfo, bind, manifests_dir
from kconvert.convert.quant_policy import FP8_BLOCK, QuantPolicy
from kconvert.io.dtypes import ITEMSIZE

COMPONENTS = ("attention", "indexer", "routed_experts", "shared_experts", "dense_mlp", "router", "norm", "embed",
              "head", "vision", "projector")
TP_DEGREES = (1, 2, 4, 8, 16, 32, 64)
GIB = 2**30
MEM_FRACTION = 0.92
RUNTIME_RESERVE = 2 * GIB
PREFILL_CHUNK = 8192
ACTIVATION_BUFFERS = 24


# ---------------------------------------------------------------------------------------------- devices
@dataclass(frozen=True)
class Device:
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
def devices() -> dict[str, Device]:
    """The presets of manifests/devices.toml, by key (H200, H100, ...)."""
    path = manifests_dir() / "devices.toml"
    try:
        spec = tomllib.loads(path.read_text())["device"]
        return {k: Device(k, d["name"], d["backend"], float(d["memory_gib"]), float(d["bandwidth_tbs"]), bool(d["fp8"]),
                          d.get("source", ""), tuple(d.get("aliases", ()))) for k, d in spec.items()}
    except (OSError, tomllib.TOMLDecodeError, KeyError, TypeError, ValueError) as e:
        raise ManifestError(f"device presets unreadable: {e.__class__.__name__}: {e}", file=str(path)) from None


def find_device(name: str) -> Device:
    """A preset by key or alias, case-insensitively. UsageError listing the known ones otherwise."""
    want = name.strip().lower()
    for d in devices().values():
        if want == d.key.lower() or want in (a.lower() for a in d.aliases):
            return d
    raise UsageError(f"unknown --device {name!r} (known: {', '.join(devices())})")


# ---------------------------------------------------------------------------------------------- tensors
@dataclass(frozen=True)
class TensorGroup:
    """`copies` tensors of one manifest rule with one shape and source dtype (the same tensor in several
    layers), each standing for every routed expert in `experts` when the rule is per expert."""

    info: TensorInfo  # the representative: the first layer's (first expert's) tensor
    shape: tuple[int, ...]
    itemsize: int  # source bytes per element: what an unquantized tensor keeps (2, or 4 for fp32)
    experts: tuple[int, ...] = ()
    copies: int = 1

    @property
    def count(self) -> int:
        return (len(self.experts) or 1) * self.copies

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.count


def _collapse(items) -> list[TensorGroup]:
    """(info, shape, itemsize), any order -> groups: experts of one (rule, layer, shape, dtype) merged,
    then equal (rule, shape, dtype, experts) merged across layers. MTP layers are left out."""
    per_layer: dict[tuple, tuple[TensorInfo, tuple, int, list[int]]] = {}
    for info, shape, itemsize in items:
        if info.component == "mtp":
            continue
        key = (info.rule.pattern, info.layer if info.expert is not None else info.name, tuple(shape), itemsize)
        if key not in per_layer:
            per_layer[key] = (info, tuple(shape), itemsize, [])
        if info.expert is not None:
            per_layer[key][3].append(info.expert)
    merged: dict[tuple, TensorGroup] = {}
    for info, shape, itemsize, experts in per_layer.values():
        key = (info.rule.pattern, shape, itemsize, tuple(sorted(experts)))
        g = merged.get(key)
        merged[key] = TensorGroup(info, shape, itemsize, key[3]) if g is None else \
            TensorGroup(g.info, shape, itemsize, key[3], g.copies + 1)
    return list(merged.values())


@functools.lru_cache(maxsize=8)
def _config_groups(config_json: str) -> tuple[ModelMap, tuple[TensorGroup, ...]]:
    model = bind(json.loads(config_json))
    shapes: dict[tuple, tuple[int, ...]] = {}  # experts of one rule and layer share one shape: evaluate once

    def items():
        for info, _ in model.expected():
            key = (info.rule.pattern, info.layer)
            if key not in shapes:
                shapes[key] = info.expected_shape()
            yield info, shapes[key], 4 if info.name.endswith("e_score_correction_bias") else 2

    return model, tuple(_collapse(items()))


def _checkpoint_groups(ck: Checkpoint) -> list[TensorGroup]:
    ck.validate()
    return _collapse((ck.info(name), t.shape, ITEMSIZE[t.main.dtype] if t.format == "plain" else 2)
                     for name, t in ck.logical.items())


def rank_bytes(groups, layout: Layout, policy: QuantPolicy, n_experts: int) -> list[dict[str, int]]:
    """Converted bytes on every rank, by component. The layout must have passed `layout.check`."""
    ranks: list[defaultdict] = [defaultdict(int) for _ in range(layout.tp)]
    per_group = n_experts // layout.ep if n_experts else 1
    for g in groups:
        comp = g.info.component
        ps = pieces(g.info, g.shape, layout, n_experts)
        memo: dict[tuple, int] = {}
        sizes = []
        for p in ps:
            shape = g.shape if p.dim is None else g.shape[:p.dim] + (p.stop - p.start,) + g.shape[p.dim + 1:]
            if shape not in memo:
                memo[shape] = policy.stored_bytes(g.info, shape, g.itemsize)
            sizes.append(memo[shape] * g.copies)
        if not g.experts:
            for p, b in zip(ps, sizes):
                ranks[p.rank][comp] += b
            continue
        # the pieces of one expert: ranks i of its group; every expert of group k lands on group k's ranks
        for k, c in Counter(e // per_group for e in g.experts).items():
            for i, b in enumerate(sizes):
                ranks[k * layout.expert_tp + i][comp] += c * b
    return [{c: r[c] for c in COMPONENTS if r.get(c)} for r in ranks]


def fp8_misaligned(groups, layout: Layout, policy: QuantPolicy, n_experts: int) -> str | None:
    """The first fp8 tensor whose per-rank slice starts inside a 128x128 scale block, if any."""
    if policy.scheme != "fp8":
        return None
    for g in groups:
        if policy.quantizes(g.info, g.shape):
            for p in pieces(g.info, g.shape, layout, n_experts):
                if p.dim is not None and p.start % FP8_BLOCK:
                    return (f"{g.info.name} splits into {p.stop - p.start}-wide slices (dim {p.dim}), not "
                            f"{FP8_BLOCK}-aligned")
    return None


# ---------------------------------------------------------------------------------------------- memory
def default_reserve(hidden_size: int) -> int:
    """Activation/workspace reserve per rank (see the module docstring)."""
    return RUNTIME_RESERVE + PREFILL_CHUNK * hidden_size * 2 * ACTIVATION_BUFFERS


def fit(device: Device, weights: int, reserve: int, kv: KVCache, context: int, batch: int,
        mem_fraction: float) -> dict:
    usable = int(device.memory_bytes * mem_fraction)
    need_kv = batch * context * kv.per_token
    free = usable - weights - reserve
    return {
        "device": device.key,
        "device_name": device.name,
        "device_bytes": device.memory_bytes,
        "usable_bytes": usable,
        "weights_bytes": weights,
        "reserve_bytes": reserve,
        "kv_bytes": need_kv,
        "fits": weights + reserve + need_kv <= usable,
        "headroom_bytes": free - need_kv,  # negative: the shortfall
        "max_context": max(free, 0) // (batch * kv.per_token) if kv.per_token else None,
    }


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
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def _open(src: str, revision: str | None):
    """(source kind, ModelMap, groups) for SRC."""
    p = Path(src)
    example = manifests_dir() / "examples" / src / "config.json"
    if not p.exists() and "/" not in src and example.is_file():
        p = example
    if p.is_dir() and not ((p / INDEX).exists() or (p / SINGLE).exists()) and (p / "config.json").is_file():
        p = p / "config.json"
    if p.is_file():
        try:
            config = json.loads(p.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"not a readable config.json: {e}", file=str(p)) from None
        if not isinstance(config, dict):
            raise CheckpointError("config.json is not a JSON object", file=str(p))
        model, groups = _config_groups(json.dumps(config, sort_keys=True))
        return "config", model, groups
    ck = Checkpoint.open(src, revision=revision, headers_only=True)
    return "checkpoint", ck.model, tuple(_checkpoint_groups(ck))


def _reason(e: UsageError) -> str:
    msg = e.message.split(" does not fit this model: ", 1)[-1]
    return msg.split("; tp degrees that work", 1)[0]


@dataclass(frozen=True)
class _Sizing:
    """Everything but the layout and the device: the model's tensors, the scheme, the workload."""

    groups: tuple[TensorGroup, ...]
    policy: QuantPolicy
    n_experts: int
    kv: KVCache
    reserve: int
    context: int
    batch: int
    mem_fraction: float

    def per_rank(self, layout: Layout) -> list[dict[str, int]]:
        return rank_bytes(self.groups, layout, self.policy, self.n_experts)

    def fit(self, device: Device, weights: int) -> dict:
        return fit(device, weights, self.reserve, self.kv, self.context, self.batch, self.mem_fraction)

    def misaligned(self, layout: Layout) -> str | None:
        return fp8_misaligned(self.groups, layout, self.policy, self.n_experts)


def _tp_table(sz: _Sizing, model: ModelMap, layout: Layout, dev: Device) -> list[dict]:
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
        try:
            lay = Layout.make(t, e)
            check(model, lay)
        except UsageError as err:
            row["reason"] = _reason(err)
            continue
        w = max(sum(r.values()) for r in sz.per_rank(lay))
        f = sz.fit(dev, w)
        row.update(ok=True, weights_per_rank=w, fits=f["fits"], headroom_bytes=f["headroom_bytes"],
                   max_context=f["max_context"], fp8_misaligned=sz.misaligned(lay))
    return table


def _warnings(sz: _Sizing, layout: Layout, dev: Device, max_pos: int) -> list[str]:
    out = []
    if max_pos and sz.context > max_pos:
        out.append(f"--context {sz.context} is beyond the model's max_position_embeddings ({max_pos}): "
                   "memory is computed, but the model was not trained for it")
    misaligned = sz.misaligned(layout)
    if misaligned:
        out.append(f"--tp {layout.tp} --ep {layout.ep} --quant fp8: {misaligned}: 128x128 scale blocks "
                   "straddle ranks, so a block-FP8 source is not resharded losslessly and engines that need "
                   "aligned slices (vLLM's block-FP8 linear) refuse it")
    if sz.policy.scheme == "fp8" and not dev.fp8:
        out.append(f"{dev.key} has no native FP8: fp8 weights take the memory shown but need a weight-only "
                   "(dequantizing) kernel there")
    if sz.kv.dtype == "fp8" and not dev.fp8:
        out.append(f"{dev.key} has no native FP8: an fp8 KV cache may not be supported by its attention kernels")
    return out


def make_plan(src: str, tp: int, ep: int | None = None, quant: str = "none", device: str = "H200",
              context: int | None = None, batch: int = 1, kv_dtype: str = "bf16", reserve_gb: float | None = None,
              mem_fraction: float = MEM_FRACTION, revision: str | None = None) -> Plan:
    """Plan SRC converted for `--tp tp --ep ep --quant quant` on `device` (see the module docstring)."""
    policy = QuantPolicy(quant)
    dev = find_device(device)
    layout = Layout.make(tp, ep)
    if batch < 1 or (context is not None and context < 1):
        raise UsageError("--batch and --context must be at least 1")
    if not 0 < mem_fraction <= 1:
        raise UsageError(f"--mem-fraction {mem_fraction} must be in (0, 1]")
    kind, model, groups = _open(src, revision)
    tc = model.text_config
    check(model, layout)  # the one-line error naming the tp degrees that work
    max_pos = int(tc.get("max_position_embeddings") or 0)
    reserve = int(reserve_gb * GIB) if reserve_gb is not None else default_reserve(int(tc["hidden_size"]))
    sz = _Sizing(groups, policy, model.text.expert_count, kv_cache(tc, kv_dtype), reserve,
                 context or max_pos or 4096, batch, mem_fraction)

    per_rank = sz.per_rank(layout)
    totals = [sum(r.values()) for r in per_rank]
    top = max(range(layout.tp), key=totals.__getitem__)
    params: dict[str, int] = defaultdict(int)
    for g in groups:
        params[g.info.component] += g.numel
    stored = [(g, policy.stored_bytes(g.info, g.shape, g.itemsize) * g.count) for g in groups]
    vision = next((p for p in model.parts if p.group == "vision"), None)
    return Plan(
        source=src, source_kind=kind, family=model.name,
        model={"layers": model.text.layer_count, "hidden_size": tc.get("hidden_size"),
               "attention_heads": tc.get("num_attention_heads"), "routed_experts": sz.n_experts,
               "experts_per_token": tc.get("num_experts_per_tok"), "kv_lora_rank": tc.get("kv_lora_rank"),
               "qk_rope_head_dim": tc.get("qk_rope_head_dim"),
               "index_head_dim": tc.get("index_head_dim") if tc.get("index_topk") else None,
               "max_position_embeddings": max_pos or None, "vision_layers": vision.layer_count if vision else 0},
        params={c: params[c] for c in COMPONENTS if params.get(c)}, total_params=sum(params.values()),
        layout={"tp": layout.tp, "ep": layout.ep, "expert_tp": layout.expert_tp}, quant=quant,
        converted_bytes=sum(b for _, b in stored),
        replicated_bytes=sum(b for g, b in stored if g.info.split == "replicate"),
        rank={"index": top, "bytes": per_rank[top], "total": totals[top], "min_total": min(totals)},
        kv_cache=sz.kv.to_json(),
        memory={**sz.fit(dev, totals[top]), "context": sz.context, "batch": batch, "mem_fraction": mem_fraction,
                "reserve_default": reserve_gb is None},
        devices=[{**sz.fit(d, totals[top]), "fp8": d.fp8, "backend": d.backend, "bandwidth_tbs": d.bandwidth_tbs}
                 for d in devices().values()],
        tp_table=_tp_table(sz, model, layout, dev), warnings=_warnings(sz, layout, dev, max_pos),
    )
