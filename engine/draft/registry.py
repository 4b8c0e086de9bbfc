"""Draft-head kinds, by name: the one place a family's draft heads are chosen (its manifest's
`[part.family.engine] draft`, read into TextConfig.draft_kind). A kind is an nn.Module built as
`cls(cfg, layer, par)` for layer `layer` >= num_hidden_layers, with:

- `load(unit, tensors, block_prefix, own_prefix, linear_format)`: its tensors from the layer's unit (engine
  names; `block_prefix` where its decoder block's tensors are, `own_prefix` where its own ones are);
- `own(component)`: its own copy of a target tensor the family's `draft_shares` names ("embed" -> a weight,
  "head" -> a linear), or None (the target's is used);
- `new_cache(model, batch, max_len, kv)`, `from_target(model, x)` (its input form of the target's last-stage
  residual) and `forward(ctx, hidden, tokens, start, cache)` -> (normed output for the head, carry for a
  chained draft). engine/draft/drafter.py runs them; a drafter of another shape (DSpark's block drafter) is a
  kind with its own Drafter."""

from __future__ import annotations

import os

from torch import nn

from engine.config import TextConfig
from engine.draft.dspark import DSparkDrafter
from engine.models.deepseek_v3.mtp import MTPHead
from engine.models.deepseek_v4.dspark import V4DsparkStage
from engine.models.deepseek_v4.mtp import V4MTPHead
from engine.models.deepseek_v41.dspark import V41DsparkStage
from engine.models.registry import kind
from kconvert.disk_format.units import layer_unit
from kconvert.distributed import Group
from kconvert.errors import CheckpointError
from kconvert.family.engine_names import engine_name
from kconvert.family.manifest import ModelMap

DRAFT: dict[str, type[nn.Module]] = {
    "mtp": MTPHead,  # DeepSeek-V3 / V3.2, Kimi-K2 / K2.5 text: eh_proj + a decoder layer + shared_head
    "v4_mtp": V4MTPHead,  # DeepSeek-V4: e_proj / h_proj + a V4 block + its own hc_head
    "dspark": V41DsparkStage,  # DeepSeek-V4.1: a stage of the DSpark block drafter (engine/draft/dspark.py)
    "v4_dspark": V4DsparkStage,  # DeepSeek-V4-0731 / -DSpark: the same drafter over V4 blocks
}

# Kinds run by a drafter of their own shape (default: engine/draft/drafter.Drafter, one head chained).
DRAFTERS: dict[str, type] = {
    "dspark": DSparkDrafter,
    "v4_dspark": DSparkDrafter,
}



def draft_head(cfg: TextConfig, layer: int, par: Group, names: ModelMap) -> nn.Module:
    """Draft layer `layer`'s module, empty (its tensors arrive with its unit). A drafter of stages (`staged`) is told
    whether this one is its first and its last by the manifest's `first_stage` / `last_stage` layer kinds, bound
    with the stages the conversion holds (`names`: V4-0731's config undercounts them), and the expert bank it routes
    over (`names.expert_bank`: V4.1's stages have their own)."""
    if cfg.draft_kind is None:
        raise CheckpointError(f"the converted checkpoint holds layer {layer} past the {cfg.num_layers} decoder "
                              "layers, and its family names no draft-head kind", file="kconvert.json")
    cls = kind(DRAFT, cfg.draft_kind, "draft head")
    if not getattr(cls, "staged", False):
        return cls(cfg, layer, par)
    part = next(p for p in names.parts if "first_stage" in p.kinds)
    return cls(cfg, layer, par, first=part.is_kind("first_stage", layer), last=part.is_kind("last_stage", layer),
               bank=names.expert_bank(layer))


def build_draft_head(model, L: int, tensors: dict, linear_format) -> nn.Module:
    """Draft layer L of `model` (engine/model.Model) filled from its unit's tensors (engine names)."""
    head = draft_head(model.cfg, L, model.par, model.names)
    own = own_prefix(model.names, L, getattr(head, "own_components", ("mtp",)))
    head.load(layer_unit(L), tensors, f"{model.layers_prefix}{L}.", own, linear_format)
    return head


def check_draft_shares(model) -> None:
    """Each draft head has what it shares with the target (the family's `draft_shares`): its own copy or the
    target's, on this (the last) stage; a conversion without it is refused, naming the tensor."""
    if not model.draft_heads:
        return
    target = {"embed": model.shared_embed, "head": model.text.lm_head if model.par.last else None}
    for L, head in model.draft_heads.items():
        for component in model.names.family.get("draft_shares", ()):
            if head.own(component) is None and target.get(component) is None:
                raise CheckpointError(f"draft head (layer {L}) uses the target's {component}, which this conversion's "
                                      "last stage does not hold", tensor=shared_tensor_name(model.names, component))


def own_prefix(names: ModelMap, layer: int, components: tuple[str, ...] | None = ("mtp",), stored: bool = False) -> str:
    """Where draft layer `layer`'s own tensors (component "mtp" in the manifest: enorm, eh_proj, e_proj, ...) sit
    in the engine's names: their common prefix (`model.layers.61.`, `mtp.0.`), from the manifest's rules.
    components=None: every tensor of the layer (a DSpark stage keeps its block under its own prefix too);
    stored: the checkpoint's names instead (what a user reads in a report)."""
    got = []
    for part in names.parts:
        for rule in part.rules:
            if (components is None or rule.component in components) and rule.layers is not None \
                    and part.layer_matches(rule, layer):
                name = rule.pattern.replace("{L}", str(layer)).replace("{M}", str(layer - part.layer_count))
                name = name.replace("{E}", "0")
                got.append(name if stored else engine_name(names, name))
    if not got and components is not None:  # a middle DSpark stage of V4's layout: its block only, no own tensor
        return own_prefix(names, layer, None, stored=True)
    if not got:
        raise CheckpointError(f"the family's manifest names no tensor of draft layer {layer}", file="kconvert.json")
    prefix = os.path.commonprefix(got)
    return prefix[:prefix.rfind(".") + 1]


def shared_tensor_name(names: ModelMap, component: str) -> str:
    """The stored name of the target tensor of `component` ("embed", "head") the manifest gives: what a draft
    head that has no copy of its own reads, named when a conversion lacks it."""
    for part in names.parts:
        for rule in part.rules:
            if rule.component == component and rule.layers is None:
                return rule.pattern
    return component
