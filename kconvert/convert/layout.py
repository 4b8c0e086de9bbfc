"""Tensor/expert-parallel layout: which slice of each tensor every rank holds.

DeepSeek's inference layout (DESIGN.md table): vocab and column-parallel tensors split dim 0, row-
parallel split dim 1, routed experts placed whole, replicated tensors copied to every rank.

`--ep M` generalises expert placement (as SGLang's moe-ep x moe-tp): the E experts are spread over M
expert groups (expert e -> group e // (E / M)), and inside a group each expert's intermediate dim
is split over the tp / M ranks of that group (gate/up dim 0, down dim 1). ep = tp (default) is
DeepSeek's whole-expert layout; ep = 1 splits every expert over all ranks (vLLM's TP MoE).
"""

from __future__ import annotations

from dataclasses import dataclass

from kconvert.errors import UsageError
from kconvert.family.manifest import ModelMap, TensorInfo

TP_DEGREES = (1, 2, 4, 8, 16, 32, 64)  # the degrees plan and shard try when suggesting alternatives


@dataclass(frozen=True)
class Layout:
    tp: int
    ep: int

    @classmethod
    def make(cls, tp: int, ep: int | None = None) -> "Layout":
        ep = tp if ep is None else ep
        if tp < 1 or ep < 1 or tp % ep:
            raise UsageError(f"--ep {ep} must divide --tp {tp} (ep = tp places whole experts; ep = 1 splits each expert)")
        return cls(tp, ep)

    @property
    def expert_tp(self) -> int:
        """Ranks sharing one expert (each holding a slice of its intermediate dim)."""
        return self.tp // self.ep


@dataclass(frozen=True, kw_only=True)
class Topology:
    """Where a conversion's tensors go: `tp` ranks (among them `ep` expert groups; None: ep = tp) times `pp` pipeline
    stages (`pp_layers` "0-14,15-30,...": their layers; None: balanced by bytes)."""

    tp: int = 1
    ep: int | None = None
    pp: int = 1
    pp_layers: str | None = None

    @property
    def layout(self) -> Layout:
        return Layout.make(self.tp, self.ep)


@dataclass(frozen=True)
class Piece:
    """Rank `rank` holds `tensor[start:stop]` along `dim` (dim None: the whole tensor)."""

    rank: int
    dim: int | None
    start: int = 0
    stop: int = 0


def split_dim(info: TensorInfo) -> int | None:
    """The dimension a tensor is cut along under tensor parallelism (None if never cut)."""
    if info.split in ("vocab", "col", "table"):
        return 0
    if info.split == "row":
        return 1
    if info.split == "expert":
        return 1 if ".down_proj." in info.name else 0
    return None


def pieces(info: TensorInfo, shape: tuple[int, ...], layout: Layout) -> list[Piece]:
    """Every rank's piece of one tensor. Raises UsageError when the cut does not divide evenly. An expert's group
    comes from its own bank (its part's expert count: DeepSeek-V4.1's drafter routes over 128 experts beside the
    backbone's 384)."""
    if info.split == "replicate":
        return [Piece(r, None) for r in range(layout.tp)]
    if info.split == "expert":
        group = info.expert // (info.rule.part.expert_count // layout.ep)
        ranks = range(group * layout.expert_tp, (group + 1) * layout.expert_tp)
        ways = layout.expert_tp
    else:
        ranks, ways = range(layout.tp), layout.tp
    dim = split_dim(info)
    if ways == 1:
        return [Piece(r, None) for r in ranks]
    n = shape[dim]
    if info.split == "table":  # a lookup table's rows (V4.1's Engram): ceil(n / ways) a rank, the last rank fewer
        step = -(-n // ways)
        return [Piece(r, dim, min(i * step, n), min((i + 1) * step, n)) for i, r in enumerate(ranks)]
    if n % ways:
        raise UsageError(f"dim {dim} of {info.name} ({n}) does not divide over {ways} ranks")
    step = n // ways
    unit = int(info.rule.part._eval(info.rule.split_multiple, info.layer)) if info.rule.split_multiple else 1
    if step % unit:
        raise UsageError(f"{info.name} ({n} along dim {dim}) would be cut inside its {unit}-wide groups over {ways} ranks")
    return [Piece(r, dim, i * step, (i + 1) * step) for i, r in enumerate(ranks)]


def check(model: ModelMap, layout: Layout, problem=None) -> None:
    """Refuse, with the tp degrees that would work, a layout the model's dims do not divide. `problem(layout)`:
    a caller's memo of layout_problem for this model (the plan's Sizing.problem), else layout_problem itself."""
    problem = problem or (lambda lay: layout_problem(model, lay))
    bad = problem(layout)
    if bad:
        # same expert mode at other degrees: whole experts (ep = tp), or the same ep where it divides tp
        candidates = [Layout(t, t if layout.ep == layout.tp else layout.ep) for t in TP_DEGREES]
        works = [c.tp for c in candidates if c.tp % c.ep == 0 and not problem(c)]
        raise UsageError(f"--tp {layout.tp} --ep {layout.ep} does not fit this model: {bad}; "
                         f"tp degrees that work: {', '.join(map(str, works)) or 'none'}")


def layout_problem(model: ModelMap, layout: Layout) -> str | None:
    """Why the model's dims do not divide over `layout`, or None when they do."""
    text = model.text
    heads = int(model.text_config.get("num_attention_heads") or 0)
    if heads and heads % layout.tp:
        return f"{heads} attention heads do not divide over {layout.tp} ranks"
    for part in model.parts:  # every bank of routed experts (a drafter's own included)
        if part.expert_count and part.expert_count % layout.ep:
            whose = "" if part is text or part.group != "text" else f" of {part.prefix.rstrip('.')}"
            return f"{part.expert_count} routed experts{whose} do not divide over {layout.ep} expert groups"
    # one representative per rule (shapes do not vary by layer or expert): fast for 3T-parameter maps
    for part in model.parts:
        for rule in part.rules:
            layers = [None] if rule.layers is None else [
                next((L for L in range(part.layer_count + part.extra_layers) if part.layer_matches(rule, L)), None)]
            if layers == [None] and rule.layers is not None:
                continue
            name = rule.pattern.replace("{L}", str(layers[0])).replace("{E}", "0")
            info = TensorInfo(name, rule, layers[0], 0 if "{E}" in rule.pattern else None)
            try:
                pieces(info, info.expected_shape(), layout)
            except UsageError as e:
                return e.message
    return None
