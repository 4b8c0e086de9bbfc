"""Which rank of a converted directory a process is: a global rank, or a (stage, tp rank) pair, checked
against the layout (global rank = stage * tp + tp rank) with one-line errors naming kconvert.json and
the valid range."""

from __future__ import annotations

from pathlib import Path

from kconvert.errors import LoaderError, UsageError
from kconvert.disk_format.catalog import MANIFEST, Catalog


def resolve_rank(cat: Catalog, root: str | Path, rank: int | None = None, *, stage: int | None = None,
                 tp_rank: int | None = None, world_size: int | None = None) -> int:
    """The global rank named by `rank`, or by `stage` and `tp_rank` (either may be left out where that
    dimension has one value: pp = 1, tp = 1). `world_size`, if given, must be tp x pp."""
    where = str(Path(root) / MANIFEST)
    tp, pp, world = cat.tp, cat.pp, cat.world_size
    layout = f"tp {tp}" + (f" x pp {pp}" if pp > 1 else "")
    if world_size is not None and world_size != world:
        hint = f"convert again with --tp {world_size}" if pp == 1 else "convert again for that many ranks"
        count = "" if pp == 1 else f" = {world} ranks"
        raise LoaderError(f"converted for {layout}{count} but the world size is {world_size}: launch {world} "
                          f"ranks (torchrun --nproc-per-node {world}) or {hint}", file=where)
    if stage is None and tp_rank is None:
        rank = 0 if rank is None else rank
        if not 0 <= rank < world:
            raise LoaderError(f"rank {rank} does not exist: converted for {layout} (ranks 0..{world - 1})", file=where)
        return rank
    if rank is not None:
        raise UsageError("name a rank either as a global rank or as --stage and --tp-rank, not both", file=where)
    if stage is None and pp > 1:
        raise UsageError(f"--tp-rank needs --stage: converted for {layout} (stages 0..{pp - 1})", file=where)
    if tp_rank is None and tp > 1:
        raise UsageError(f"--stage needs --tp-rank: converted for {layout} (tp ranks 0..{tp - 1})", file=where)
    stage, tp_rank = stage or 0, tp_rank or 0
    if not 0 <= stage < pp:
        raise LoaderError(f"stage {stage} does not exist: converted for {layout} (stages 0..{pp - 1})", file=where)
    if not 0 <= tp_rank < tp:
        raise LoaderError(f"tp rank {tp_rank} does not exist: converted for {layout} (tp ranks 0..{tp - 1})",
                          file=where)
    return cat.rank_of(stage, tp_rank)
