"""A calibrated layer's GPTQ work divided among the processes of a torchrun (engine/calibrate/layerwise.py uses it).

Every process runs the layer's forward passes itself: the same float operations on the same inputs give the
same activations, bit for bit (calibration runs one thread). Each then computes the codes of its share:
routed expert e on process e % P, the k-th other calibrated linear of the layer (shared expert, dense MLP,
in the layer's order) on process k % P, each from its own Hessian as one process would. Every weight's
codes and scales then go from their process to all (one broadcast each, in the layer's order), so each
process holds the whole quantized layer for the pass that makes the next layer's input, and the codes are
those of a single-process run, byte for byte. Resume state (the kept layer inputs) is process 0's: it writes
and deletes them and says where a re-run starts; the others follow. One process: every call is trivial."""

from __future__ import annotations

import torch

from kconvert.distributed import Group


class Split:
    def __init__(self, group: Group | None = None):
        self.group = group or Group()

    @property
    def world(self) -> int:
        return self.group.world

    @property
    def keeps(self) -> bool:
        """This process writes and deletes the resume state."""
        return self.group.rank == 0

    def owner(self, k: int) -> int:
        """The process of routed expert k (or of the k-th other calibrated linear)."""
        return k % self.world

    def owns(self, k: int) -> bool:
        return self.owner(k) == self.group.rank

    def agree(self, obj):
        """Process 0's obj, on every process."""
        return self.group.broadcast_object(obj, 0)

    def barrier(self) -> None:
        self.group.barrier()

    def gather(self, mine: dict[str, tuple[torch.Tensor, torch.Tensor]],
               owner: dict[str, int]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """{name: (codes, scale)} of every weight in `owner` ({name: process}, the same order everywhere) that
        another process computed; `mine` holds this process's."""
        if self.world == 1:
            return {}
        shapes = {n: [(tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in pair] for n, pair in mine.items()}
        shapes = {n: s for part in self.group.all_gather_object(shapes) for n, s in part.items()}
        got = {}
        for name, src in owner.items():
            if src == self.group.rank:
                pair = tuple(t.contiguous() for t in mine[name])
            else:
                pair = tuple(torch.empty(shape, dtype=getattr(torch, dtype)) for shape, dtype in shapes[name])
                got[name] = pair
            for t in pair:  # as bytes: the collective backend need not know every dtype (bf16 scales)
                self.group.broadcast(t.view(torch.uint8), src)
        return got
