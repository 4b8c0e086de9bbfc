"""Per-tensor scales fixed before any part of a tensor is written (schemes with `per_tensor`: nvfp4's weight_scale_2).

Serving engines run an expert's gate and up projections (w1, w3) as one GEMM with one per-tensor scale (vLLM's
ModelOpt NVFP4 MoE warns and takes w1's when they differ), so the members of a fused group (manifest `fuse`: the same
name in one layer and expert) take the largest of their own scales: every block each would hold on its own it still
holds (an MXFP4 cast keeps every block of its window; a larger amax only coarsens the block scales a little). A tensor
cut for several ranks takes its whole tensor's scale on every rank, as one tensor's. `shard` and `export` both ask."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kconvert.family.manifest import TensorInfo


def fused_key(info: TensorInfo) -> tuple | None:
    """What the members of `info`'s fused group share (None: not fused): the rule's `fuse`, its part, layer, expert."""
    fuse = info.rule.fuse
    return None if fuse is None else (fuse, info.rule.part.prefix, info.layer, info.expert)


def tensor_scales(members: Iterable[tuple[str, TensorInfo, object, object, bool]],
                  load: Callable[[str], object]) -> dict[str, float]:
    """{source name: per-tensor scale} of the `members` that need one fixed first: (name, info, scheme, lossless copy,
    cut for several ranks) each; `load(name)` reads what the scheme's `tensor_scale` reads (the value, or the copy's
    parts). A fused group's members all take its largest; a cut tensor its own whole one."""
    groups: dict = {}
    for name, info, scheme, copy, cut in members:
        if scheme is None or not scheme.per_tensor:
            continue
        key = fused_key(info)
        if key is None and not cut:
            continue
        groups.setdefault(key or ("cut", name), []).append((name, scheme, copy))
    out: dict[str, float] = {}
    for group in groups.values():
        scale = group[0][1].shared_scale([(name, load(name), copy) for name, _, copy in group])
        out.update((name, scale) for name, _, _ in group)
    return out
