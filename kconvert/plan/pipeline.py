"""`kconvert plan --pp P`: tensor x pipeline parallelism, from shapes only.

Each stage's ranks hold their stage's layers (split by `convert.stages`, the function `shard --pp` uses,
fed the same per-rank bytes) plus the edges: embeddings and vision tower on the first stage, final norm
and head on the last. The KV cache is per layer, so a stage keeps only its own layers' KV: per rank,
batch x context x KV bytes per token per layer x the stage's layer count. A tp x pp layout fits when
every stage fits (memory.py's model: weights + reserve + KV <= usable); its max context is the least of
its stages'. The search tries every tp degree (same expert mode) with pp = 1, 2, ... up to MAX_PP and
keeps, per tp, the smallest pp that fits; the smallest (tp, pp) overall has the fewest devices, then tp
inside one node (tensor parallelism needs the fast links), then the fewer stages (less pipeline bubble).
"""

from __future__ import annotations

import dataclasses

from kconvert.convert.layout import TP_DEGREES, Layout
from kconvert.convert.stages import FIRST, LAST, edges_of, split_layers
from kconvert.family.manifest import ModelMap
from kconvert.plan.device_presets import DevicePreset
from kconvert.plan.fit import Sizing, fit

MAX_PP = 16  # stages the search tries per tp degree
GPUS_PER_NODE = 8


@dataclasses.dataclass(frozen=True)
class StageInputs:
    """What convert.stages splits: bytes per tp rank of every decoder layer, and of each edge."""

    layer_bytes: list[list[int]]
    first: list[int]
    last: list[int]


def stage_inputs(sz: Sizing, model: ModelMap, layout: Layout) -> StageInputs:
    n_layers = model.text.layer_count
    tied = bool(model.text_config.get("tie_word_embeddings")) and not any(
        g.info.component == "head" for g in sz.groups)
    layer_bytes = [[0] * layout.tp for _ in range(n_layers)]
    edge = {FIRST: [0] * layout.tp, LAST: [0] * layout.tp}
    for g, per in zip(sz.groups, sz.copies(layout)):
        for L in g.layers or (None,) * g.copies:
            rows = [layer_bytes[L]] if L is not None and L < n_layers else \
                [edge[LAST]] if L is not None else [edge[e] for e in edges_of(g.info.component, tied)]
            for row in rows:
                for r, b in enumerate(per):
                    row[r] += b
    return StageInputs(layer_bytes, edge[FIRST], edge[LAST])


def pipeline_fit(sz: Sizing, inputs: StageInputs, layout: Layout, pp: int, dev: DevicePreset,
                 pp_layers: str | None = None, gpus_per_node: int = GPUS_PER_NODE) -> dict:
    """Every stage of a tp x pp layout on `dev`: its layers, weights and KV per rank, and whether it fits."""
    split = split_layers(inputs.layer_bytes, pp, inputs.first, inputs.last, pp_layers)
    stages = []
    for s, (a, b) in enumerate(split.layers):
        kv = sz.kv.stage(a, b).on_tp(layout.tp)
        stages.append({"stage": s, "layers": [a, b - 1], "layer_count": b - a,
                       **fit(dev, split.bytes[s], sz.reserve, kv, sz.context, sz.batch, sz.mem_fraction,
                             sz.max_position)})
    worst = min(stages, key=lambda f: f["headroom_bytes"])
    contexts = [f["max_context"] for f in stages if f["max_context"] is not None]
    world = layout.tp * pp
    return {"tp": layout.tp, "ep": layout.ep, "pp": pp, "world_size": world,
            "nodes": -(-world // gpus_per_node), "gpus_per_node": gpus_per_node, "pp_layers": split.spec,
            "imbalance": split.imbalance, "weights_per_rank": max(split.bytes), "min_weights_per_rank": min(split.bytes),
            "fits": all(f["fits"] for f in stages), "headroom_bytes": worst["headroom_bytes"],
            "max_context": min(contexts) if contexts else None, "binding_stage": worst["stage"], "stages": stages}


def search(sz: Sizing, model: ModelMap, layout: Layout, dev: DevicePreset, gpus_per_node: int = GPUS_PER_NODE,
           max_pp: int = MAX_PP) -> dict:
    """Per tp degree (in `layout`'s expert mode), the smallest pp that fits `dev`; and the best of them."""
    rows = []
    for t in TP_DEGREES:
        e = t if layout.ep == layout.tp else layout.ep
        row = {"tp": t, "ep": e, "pp": None, "fits": False, "reason": f"--ep {e} does not divide tp {t}"}
        rows.append(row)
        if t % e:
            continue
        lay = Layout(t, e)
        row["reason"] = sz.problem(lay)
        if row["reason"]:
            continue
        inputs = stage_inputs(sz, model, lay)
        usable = int(dev.memory_bytes * sz.mem_fraction)
        total = max(sum(row[r] for row in inputs.layer_bytes) + inputs.first[r] + inputs.last[r] for r in range(t))
        for pp in range(1, min(max_pp, len(inputs.layer_bytes)) + 1):
            if -(-total // pp) + sz.reserve > usable:  # even a perfect split leaves a stage too big: skip it
                continue
            r = pipeline_fit(sz, inputs, lay, pp, dev, gpus_per_node=gpus_per_node)
            if r["fits"]:
                row.update({k: v for k, v in r.items() if k != "stages"})
                break
        else:
            row["reason"] = f"does not fit with up to {max_pp} stages"
    fitting = [r for r in rows if r["fits"]]
    best = min(fitting, key=lambda r: (r["world_size"], r["tp"] > gpus_per_node, r["pp"]), default=None)
    return {"device": dev.key, "context": sz.context, "batch": sz.batch, "gpus_per_node": gpus_per_node,
            "max_pp": max_pp, "rows": rows, "best": best}
