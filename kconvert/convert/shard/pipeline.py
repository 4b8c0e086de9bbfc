"""Place a conversion's tp-rank work items (shard_plan.plan_items) on pipeline stages: global ranks, the layer
split that balances the bytes each rank writes (convert/stages.py), and every stage's units."""

from __future__ import annotations

from dataclasses import dataclass

from kconvert.convert.shard.outputs import WorkItem
from kconvert.convert.stages import FIRST, LAST, StageSplit, edges_of, split_layers
from kconvert.disk_format.units import GLOBALS, VISION, unit_layer


@dataclass
class Pipeline:
    """A conversion's pipeline stages: the work items with global ranks (stage * tp + tp rank), the layer
    split and every stage's units (the catalog's layout.stages)."""

    items: list[WorkItem]
    split: StageSplit
    stage_units: list[list[str]]


def plan_pipeline(items: list[WorkItem], tp: int, pp: int, n_layers: int, *, pp_layers: str | None = None,
                  tied: bool = False, draft_embed: bool = False) -> Pipeline:
    """Place the tp-rank work items of `plan_items` on `pp` stages. The split balances the bytes each
    rank will write (convert.stages); `globals` is cut in two with pp > 1: embeddings on the first stage,
    final norm and head on the last (the embeddings too when `tied` and there is no head); vision and
    the first layers on the first stage, MTP layers (n_layers and up: the draft heads) on the last, with the
    embeddings when `draft_embed` (the family's draft heads read the target's) and there are draft heads.
    pp = 1: the items are returned unchanged."""
    tied_without_head = tied and not any(o.info.component == "head" for w in items for o in w.outputs)
    draft_embed = draft_embed and any((unit_layer(w.unit) or 0) >= n_layers for w in items)
    layer_bytes = [[0] * tp for _ in range(n_layers)]
    edge = {FIRST: [0] * tp, LAST: [0] * tp}
    for w in items:
        L = unit_layer(w.unit)
        if L is not None and L < n_layers:
            layer_bytes[L][w.rank] += w.bytes_out
            continue
        for o in w.outputs:  # globals, vision, MTP layers: by what each tensor is
            to = (LAST,) if L is not None else edges_of(o.info.component, tied_without_head, draft_embed)
            for e in to:
                edge[e][w.rank] += o.bytes_out
    split = split_layers(layer_bytes, pp, edge[FIRST], edge[LAST], pp_layers)
    units = [[] for _ in range(pp)]
    for u in dict.fromkeys(w.unit for w in items):
        L = unit_layer(u)
        stages = {0, pp - 1} if u == GLOBALS else {0} if u == VISION else {split.stage_of_layer(L)}
        for s in sorted(stages):
            units[s].append(u)
    if pp == 1:
        return Pipeline(items, split, units)
    placed: list[WorkItem] = []
    for w in items:
        L = unit_layer(w.unit)
        if w.unit != GLOBALS:
            s = 0 if L is None else split.stage_of_layer(L)
            placed.append(WorkItem(s * tp + w.rank, w.unit, w.outputs))
            continue
        for s, e in ((0, FIRST), (pp - 1, LAST)):
            outs = [o for o in w.outputs if e in edges_of(o.info.component, tied_without_head, draft_embed)]
            placed.append(WorkItem(s * tp + w.rank, w.unit, outs))
    order = {GLOBALS: -2, VISION: -1}
    placed.sort(key=lambda w: (order.get(w.unit, 0), w.unit, w.rank))
    return Pipeline(placed, split, units)
