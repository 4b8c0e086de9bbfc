"""A checkpoint's logical tensors by name, made from the validated buckets' stored columns when asked for, so a
conversion that reads most of them as stacks never folds them one by one.

Kimi K3's 250k MXFP4 experts cost 0.6-0.8 s to fold into LogicalTensors (logical.fold; bench/shard_phases.py
prints it, run on a tree from before this module: 0.00 s on this one), a sixth of shard's work beyond its data,
while shard reads them as stacks of a layer's experts at a time (source/stacked.py), from their stored entries
alone. Here a name is looked up in an index of the columnar buckets (source/stored_groups.py), its LogicalTensor
made on request (as fold makes it: tests/source/test_stored_groups.py), and a stack's stored parts handed over as columns
(`columns`). Walking the whole mapping (items, values, iteration) folds it once, in fold's order, and answers from
the fold thereafter.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from itertools import repeat

from kconvert.io.gc_pause import paused_gc
from kconvert.io.safetensors_read import TensorEntry
from kconvert.source.logical import LogicalTensor
from kconvert.source.tensor_groups import Bucket


class LogicalByName(Mapping):
    """Name -> LogicalTensor over columnar buckets (their `tensors` are stored_groups.Members); `fold()` gives the
    same tensors as a dict, in fold's order, made once when the mapping is walked."""

    def __init__(self, buckets: list[Bucket], fold: Callable[[], dict[str, LogicalTensor]]):
        self._buckets, self._fold = buckets, fold
        self._where: dict[str, tuple] | None = None  # name -> (Members, position)
        self._folded: dict[str, LogicalTensor] | None = None

    def _index(self) -> dict[str, tuple]:
        where = self._where
        if where is None:
            with paused_gc():  # 250k small tuples: no cycles
                where = {}
                for b in self._buckets:
                    m = b.tensors
                    where.update(zip(m.names, zip(repeat(m), range(len(m)))))
            self._where = where  # (two threads may build it at once: the same index, one kept)
        return where

    def folded(self) -> dict[str, LogicalTensor]:
        if self._folded is None:
            self._folded = self._fold()
        return self._folded

    def __getitem__(self, name: str) -> LogicalTensor:
        if self._folded is not None:
            return self._folded[name]
        members, i = self._index()[name]
        return members[i]

    def __contains__(self, name: object) -> bool:
        return name in (self._folded if self._folded is not None else self._index())

    def __iter__(self) -> Iterator[str]:
        return iter(self.folded())

    def __len__(self) -> int:
        return len(self._folded if self._folded is not None else self._index())

    def keys(self):
        return self.folded().keys()

    def values(self):
        return self.folded().values()

    def items(self):
        return self.folded().items()

    def columns(self, names: list[str]) -> tuple[LogicalTensor, dict[str, list[TensorEntry]]]:
        """Logical weights `names`, stored in one form: the first one's LogicalTensor and each stored part's entries
        for all of them, by role (what source/stacked.py reads a stack from). A stack is read as its first entry's
        dtype (io/stacked_read.py): only the first is remade as fold makes it (MXFP4's U8 scales read as e8m0), the
        rest are the stored entries."""
        if self._folded is not None:
            return parts_by_role([self._folded[n] for n in names])
        where = list(map(self._index().__getitem__, names))
        m0, i0 = where[0]
        t0 = m0[i0]
        cols = {role: [m.columns[k][i] for m, i in where] for k, role in enumerate(m0.roles)}
        for role, entry in t0.roles:  # the first's entries as fold makes them (MXFP4's scales read as e8m0)
            cols[role][0] = entry
        return t0, cols


def parts_by_role(ts: list[LogicalTensor]) -> tuple[LogicalTensor, dict[str, list[TensorEntry]]]:
    """The same as LogicalByName.columns, from the LogicalTensors themselves."""
    t0 = ts[0]
    if t0.format == "plain":
        return t0, {"weight": [t.stored for t in ts]}
    return t0, {role: [t.stored[role] for t in ts] for role in t0.stored}


def stack_columns(logical: Mapping, names: list[str]) -> tuple[LogicalTensor, dict[str, list[TensorEntry]]]:
    """Checkpoint.logical's weights `names` as a stack's first LogicalTensor and stored parts by role."""
    if isinstance(logical, LogicalByName):
        return logical.columns(names)
    return parts_by_role(list(map(logical.__getitem__, names)))
