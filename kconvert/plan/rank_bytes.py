"""What each rank holds after conversion, in bytes per component, computed from tensor shapes only:
`layout.pieces` gives each rank's slice and `QuantPolicy.stored_bytes` its size (scales included).
Tensors that differ only by layer or expert are collapsed into groups, so a 3T-parameter model is a
few hundred groups, not millions of tensors."""

from __future__ import annotations

import functools
import json
from collections import Counter, defaultdict
from typing import NamedTuple

from kconvert.source.checkpoint import Checkpoint
from kconvert.convert.layout import Layout, pieces
from kconvert.family.manifest import ModelMap, TensorInfo, bind
from kconvert.quant.policy import QuantPolicy
from kconvert.io.dtypes import ITEMSIZE

# every component a manifest names, in report order (a draft head's tensors, whatever their rule, are "mtp")
COMPONENTS = ("attention", "kda", "compressor", "indexer", "mhc", "attn_res", "routed_experts", "latent", "shared_experts", "engram",
              "dense_mlp", "router", "hash_router", "norm", "embed", "head", "mtp", "vision", "projector")


class TensorGroup(NamedTuple):
    """`copies` tensors of one manifest rule with one shape and source dtype (the same tensor in several
    layers), each standing for every routed expert in `experts` when the rule is per expert (a named tuple:
    plan builds one per bucket, 1k+ at a release's size)."""

    info: TensorInfo  # the representative: the first layer's (first expert's) tensor
    shape: tuple[int, ...]
    itemsize: int  # source bytes per element: what an unquantized tensor keeps (2, or 4 for fp32)
    experts: tuple[int, ...] = ()
    copies: int = 1
    layers: tuple[int | None, ...] = ()  # the layer of every copy (None: not in a layer)

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
    """(info, shape, itemsize, experts), any order -> groups: experts of one (rule, layer, shape, dtype) merged,
    then equal (rule, shape, dtype, experts) merged across layers. Draft heads (MTP, DSpark stages) are counted: shard
    keeps them by default (their experts placed by their own bank, on the last pipeline stage)."""
    per_layer: dict[tuple, tuple[TensorInfo, tuple, int, list[int]]] = {}
    for info, shape, itemsize, experts in items:
        key = (info.rule.pattern, info.layer if info.expert is not None else info.name, tuple(shape), itemsize)
        if key not in per_layer:
            per_layer[key] = (info, tuple(shape), itemsize, [])
        per_layer[key][3].extend(experts)
    merged: dict[tuple, TensorGroup] = {}
    for info, shape, itemsize, experts in per_layer.values():
        key = (info.rule.pattern, shape, itemsize, tuple(sorted(experts)))
        g = merged.get(key)
        merged[key] = TensorGroup(info, shape, itemsize, key[3], 1, (info.layer,)) if g is None else \
            TensorGroup(g.info, shape, itemsize, key[3], g.copies + 1, g.layers + (info.layer,))
    return list(merged.values())


@functools.lru_cache(maxsize=8)
def config_groups(config_json: str, config_file: str = "config.json") -> tuple[ModelMap, tuple[TensorGroup, ...]]:
    """Groups of a model known only by its config (cached: `plan` asks again for every tp degree)."""
    model = bind(json.loads(config_json), config_file=config_file)

    def items():
        for rule, layer, required, names in model.expected_groups():
            if required or (layer is not None and layer >= rule.part.layer_count and rule.part.group == "text"):
                # the draft stages the config counts too: a release ships them and shard keeps them
                experts = list(range(len(names))) if "{E}" in rule.pattern else []
                info = TensorInfo(names[0], rule, layer, 0 if experts else None)
                stored = ITEMSIZE[rule.dtype] if rule.dtype else 4 if names[0].endswith("e_score_correction_bias") else 2
                yield info, info.expected_shape(), stored, experts

    return model, tuple(_collapse(items()))


def checkpoint_groups(ck: Checkpoint) -> list[TensorGroup]:
    """Groups of a checkpoint's tensors (from its validated buckets), in model order: the order `config_groups`
    gives the same model, so a plan from the checkpoint and one from its config.json name the same tensor (a
    misaligned fp8 slice), whatever order the files store them in."""
    def itemsize(t) -> int:
        return ITEMSIZE[t.main.dtype] if t.format == "plain" else 2

    return _collapse((b.info, b.sample.shape, itemsize(b.sample), b.experts if b.experts[0] is not None else [])
                     for b in ck.grouped.buckets)


def copy_bytes(g: TensorGroup, layout: Layout, policy: QuantPolicy) -> list[int]:
    """Converted bytes of one copy of group `g` (one layer's tensor, every expert it stands for) on every rank."""
    out = [0] * layout.tp
    ps = pieces(g.info, g.shape, layout)
    memo: dict[tuple, int] = {}
    sizes = []
    for p in ps:
        shape = g.shape if p.dim is None else g.shape[:p.dim] + (p.stop - p.start,) + g.shape[p.dim + 1:]
        if shape not in memo:
            memo[shape] = policy.stored_bytes(g.info, shape, g.itemsize)
        sizes.append(memo[shape])
    if not g.experts:
        for p, b in zip(ps, sizes):
            out[p.rank] += b
        return out
    # the pieces of one expert: ranks i of its group; every expert of group k lands on group k's ranks
    per_group = g.info.rule.part.expert_count // layout.ep  # the expert's own bank
    for k, c in Counter(e // per_group for e in g.experts).items():
        for i, b in enumerate(sizes):
            out[k * layout.expert_tp + i] += c * b
    return out


def rank_bytes(groups, copies: list[list[int]], tp: int) -> list[dict[str, int]]:
    """Converted bytes on every one of `tp` ranks, by component, from each group's copy_bytes (Sizing.copies). The
    layout must have passed `layout.check`."""
    ranks: list[defaultdict] = [defaultdict(int) for _ in range(tp)]
    for g, per in zip(groups, copies):
        for r, b in enumerate(per):
            ranks[r][g.info.component] += b * g.copies
    return [{c: r[c] for c in COMPONENTS if r.get(c)} for r in ranks]


def fp8_misaligned(groups, layout: Layout, policy: QuantPolicy) -> str | None:
    """The first fp8 tensor whose per-rank slice starts inside a scale block (the run's block: 128 x 128, or a
    block-FP8 source's own, DeepSeek-V4.1's 32 x 32), if any."""
    if policy.scheme != "fp8":
        return None
    block = policy.fp8_block
    for g in groups:
        if policy.quantizes(g.info, g.shape):
            for p in pieces(g.info, g.shape, layout):
                if p.dim is not None and p.start % block:
                    return (f"{g.info.name} splits into {p.stop - p.start}-wide slices (dim {p.dim}), not "
                            f"{block}-aligned")
    return None


# ---------------------------------------------------------------------------------------------- memory
