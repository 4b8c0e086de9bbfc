"""Process group for multi-process conversion under torchrun (RANK / WORLD_SIZE in the environment).

Only coordination is needed (barriers), so the backend is always gloo on CPU, whatever device the
converted model will later run on. A single process needs no group at all.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass


@dataclass
class Group:
    rank: int = 0
    world: int = 1

    @classmethod
    def from_env(cls) -> "Group":
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls()
        import torch.distributed as dist

        if not dist.is_initialized():
            # conversions of terabytes take hours: barriers must not time out at gloo's default 30 min
            dist.init_process_group("gloo", timeout=datetime.timedelta(hours=48))
        return cls(dist.get_rank(), dist.get_world_size())

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()
