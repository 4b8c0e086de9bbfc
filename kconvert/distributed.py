"""The process group of a multi-process run (RANK / WORLD_SIZE in the environment, set by torchrun or by
`engine.launch`), used by conversion (barriers only) and by the engine (tensor-parallel collectives).

A single process needs no group at all: every collective is then the identity.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

from kconvert import devices
from kconvert.errors import EngineError

# How long a collective may wait. Not torch's 30 minutes: a conversion's barrier waits while another rank
# writes its share of a terabyte, and chat's ranks wait in a broadcast while the user types.
TIMEOUT = datetime.timedelta(hours=48)


def world_from_env() -> int:
    """The world size a launcher (torchrun, engine.launch) set for this process; 1 when none did."""
    return int(os.environ.get("WORLD_SIZE", "1"))


@dataclass
class Group:
    rank: int = 0
    world: int = 1

    @classmethod
    def from_env(cls, device="cpu") -> "Group":
        """Join the launcher's group (or run alone). On an accelerator each process takes device LOCAL_RANK."""
        if world_from_env() <= 1:
            return cls()
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            dev = torch.device(device)
            if dev.type != "cpu":  # each process takes the device of its local rank
                devices.set_current(torch.device(dev.type, int(os.environ.get("LOCAL_RANK", "0"))))
            dist.init_process_group(devices.collective_backend(dev), timeout=TIMEOUT)
        return cls(dist.get_rank(), dist.get_world_size())

    def check_tp(self, tp: int) -> None:
        if tp != self.world:
            raise EngineError(
                f"checkpoint was converted for tp={tp} but {self.world} process(es) are running: "
                f"launch {tp} (python -m engine.chat does it itself; under torchrun: --nproc-per-node {tp})"
                if tp > 1 else
                f"checkpoint was converted for tp=1 but {self.world} processes are running: run it without torchrun")

    def close(self) -> None:
        """Leave the group together: a rank that exits while another still talks to it can abort the other."""
        if self.world > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.barrier()
                dist.destroy_process_group()

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def all_reduce(self, x):
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(x)
        return x

    def all_gather_last(self, x):
        """Concatenate every rank's x along the last dim (vocab-parallel logits)."""
        if self.world == 1:
            return x
        import torch
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
