"""Tensor-parallel context over torch.distributed (single process when world size is 1)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kconvert.errors import KConvertError
from kconvert.load import devices


@dataclass
class Parallel:
    rank: int = 0
    world: int = 1

    @classmethod
    def from_env(cls, device: str | torch.device = "cpu") -> "Parallel":
        """Join the torchrun group (RANK / WORLD_SIZE in the environment), or run alone."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls()
        import torch.distributed as dist

        if not dist.is_initialized():
            dev = torch.device(device)
            if dev.type != "cpu":
                devices.set_current(torch.device(dev.type, int(os.environ.get("LOCAL_RANK", "0"))))
            dist.init_process_group(devices.collective_backend(dev))
        return cls(dist.get_rank(), dist.get_world_size())

    def check_tp(self, tp: int) -> None:
        if tp != self.world:
            raise KConvertError(
                f"checkpoint was converted for tp={tp} but {self.world} process(es) are running: "
                f"launch with torchrun --nproc-per-node {tp}" if tp > 1 else
                f"checkpoint was converted for tp=1 but {self.world} processes are running: run it without torchrun")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's x along the last dim (vocab-parallel logits)."""
        if self.world == 1:
            return x
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def broadcast_object(self, obj, src: int = 0):
        if self.world == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]
