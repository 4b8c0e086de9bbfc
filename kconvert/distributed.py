"""The process group of a multi-process run (RANK / WORLD_SIZE in the environment, set by torchrun or by
`engine.runtime.launch`), used by conversion (barriers only) and by the engine: tensor parallelism inside a
pipeline stage, point-to-point hidden states between stages.

Topology (tp x pp; the converted checkpoint's layout): global rank = stage * tp + tp_rank. The ranks of
one stage form its tensor-parallel group (all_reduce, all_gather_last); a stage passes its hidden states
to the same tp rank of the next stage (send/recv); the last stage's results (a sampled token, logits)
are broadcast to every rank. A single process needs no group at all: every collective is the identity.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field, replace

from kconvert.errors import EngineError

# How long a collective may wait. Not torch's 30 minutes: a conversion's barrier waits while another rank
# writes its share of a terabyte, and chat's ranks wait in a broadcast while the user types.
TIMEOUT = datetime.timedelta(hours=48)

FROZEN_S = 5.0  # a rank stopped (SIGSTOP, a debugger) this long ends the run: its peers would wait TIMEOUT


def is_stopped(pid: int) -> bool:
    """Whether process `pid` is stopped by a signal or a tracer (Linux /proc state T or t). A stopped rank
    blocks every collective for TIMEOUT, which cannot be short (see above), so launchers watch for this."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:][:1] in (b"T", b"t")


class StoppedWatch:
    """Which of some processes has stayed stopped for FROZEN_S: `frozen({rank: pid})` -> a rank or None."""

    def __init__(self, limit_s: float = FROZEN_S):
        self.limit_s, self.since = limit_s, {}

    def frozen(self, pids: dict[int, int]) -> int | None:
        import time

        now = time.monotonic()
        for rank, pid in pids.items():
            if not is_stopped(pid):
                self.since.pop(rank, None)
            elif now - self.since.setdefault(rank, now) >= self.limit_s:
                return rank
        return None


_TP_GROUPS: dict[tuple[int, int], list] = {}  # (tp, pp) -> every stage's tp group, made once per process


def peer_gone(e: BaseException) -> str | None:
    """The line for a collective's error caused by another process of this run ending first (gloo's "Connection
    closed by peer", torch's DistError family), or None for any other error. A surviving torchrun worker saw
    gloo's RuntimeError and called it an internal error of kconvert; the process that ended says why itself."""
    if world_from_env() <= 1 or not isinstance(e, RuntimeError):
        return None
    import torch.distributed as dist

    text = str(e)
    if not (isinstance(e, getattr(dist, "DistError", ())) or "gloo" in text.lower() or "closed by peer" in text):
        return None
    why = text.split("] ", 1)[-1].split(". ", 1)[0][:200]  # gloo's sentence, without its source path
    return (f"rank {os.environ.get('RANK', '?')}: another process of this run ended first ({why}); its own output "
            "says why")


def world_from_env() -> int:
    """The world size a launcher (torchrun, engine.runtime.launch) set for this process; 1 when none did."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def launch_line(tp: int, pp: int) -> str:
    """How to start a tp x pp run, for error messages."""
    world = tp * pp
    if world == 1:
        return "run it without torchrun"
    return (f"launch {world} ranks (python -m engine.chat does it itself; torchrun: --nproc-per-node {world} on one "
            f"machine, or --nnodes N --nproc-per-node {world}/N on each of N)")


@dataclass
class Group:
    rank: int = 0  # global rank
    world: int = 1  # global world size
    tp: int = 0  # tensor-parallel degree (0: not laid out yet, i.e. the whole world)
    pp: int = 1  # pipeline stages
    _tp_group: object = field(default=None, repr=False, compare=False)  # None: the default (whole world) group

    def __post_init__(self):
        if not self.tp:
            self.tp = self.world

    @classmethod
    def from_env(cls, device="cpu") -> "Group":
        """Join the launcher's group (or run alone). On an accelerator each process takes device LOCAL_RANK.
        The whole world is one tensor-parallel group until `layout(tp, pp)` says otherwise."""
        if world_from_env() <= 1:
            return cls()
        import torch
        import torch.distributed as dist

        from kconvert import devices  # (torch's: a process that never joins a group, as pack, never imports it)

        if not dist.is_initialized():
            dev = torch.device(device)
            if dev.type != "cpu":  # each process takes the device of its local rank
                devices.set_current(torch.device(dev.type, int(os.environ.get("LOCAL_RANK", "0"))))
            dist.init_process_group(devices.collective_backend(dev), timeout=TIMEOUT)
        return cls(dist.get_rank(), dist.get_world_size())

    # ---- topology -------------------------------------------------------------------------------
    def layout(self, tp: int, pp: int = 1, file: str | None = None) -> "Group":
        """This group seen as tp x pp (a converted checkpoint's layout, described by `file`): checks the
        launched world, and makes every stage's tensor-parallel group (every rank makes all of them, in
        the same order, as torch.distributed requires; once per process)."""
        if tp * pp != self.world:
            layout = f"tp {tp} x pp {pp} = {tp * pp} ranks" if pp > 1 else f"tp {tp}"
            raise EngineError(f"checkpoint was converted for {layout} but {self.world} process(es) are running: "
                              f"{launch_line(tp, pp)}", file=file)
        group = None
        if 1 < tp < self.world:
            import torch.distributed as dist

            if (tp, pp) not in _TP_GROUPS:
                _TP_GROUPS[(tp, pp)] = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(pp)]
            group = _TP_GROUPS[(tp, pp)][self.rank // tp]
        return replace(self, tp=tp, pp=pp, _tp_group=group)

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def stage(self) -> int:
        return self.rank // self.tp

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.pp - 1

    @property
    def last_rank(self) -> int:
        """The rank that speaks for the last stage (its tp rank 0): it samples and sends results."""
        return (self.pp - 1) * self.tp

    def rank_of(self, stage: int, tp_rank: int | None = None) -> int:
        return stage * self.tp + (self.tp_rank if tp_rank is None else tp_rank)

    # ---- lifetime -------------------------------------------------------------------------------
    def close(self) -> None:
        """Leave the group together: a rank that exits while another still talks to it can abort the other."""
        if self.world > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.barrier()
                dist.destroy_process_group()
                _TP_GROUPS.clear()

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    # ---- tensor parallel (this stage's ranks) ---------------------------------------------------
    def all_reduce(self, x):
        if self.tp > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self._tp_group)
        return x

    def all_gather_last(self, x):
        """Concatenate this stage's ranks' x along the last dim (vocab-parallel logits)."""
        if self.tp == 1:
            return x
        import torch
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.tp)]
        dist.all_gather(parts, x.contiguous(), group=self._tp_group)
        return torch.cat(parts, dim=-1)

    # ---- pipeline (point to point, whole world) -------------------------------------------------
    def send(self, x, dst: int, wait: bool = True):
        """Send x to rank dst; with wait=False the returned handle's wait() must come before x is reused."""
        import torch.distributed as dist

        work = dist.isend(x.contiguous(), dst)
        if wait:
            work.wait()
            return None
        return work

    def recv(self, shape, dtype, device, src: int):
        import torch
        import torch.distributed as dist

        x = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(x, src)
        return x

    def send_next(self, x, wait: bool = True):
        """To the same tp rank of the next stage."""
        return self.send(x, self.rank + self.tp, wait)

    def recv_prev(self, shape, dtype, device):
        """From the same tp rank of the previous stage."""
        return self.recv(shape, dtype, device, self.rank - self.tp)

    def broadcast(self, x, src: int):
        """Every rank gets src's x; the others pass a buffer of the same shape and dtype."""
        if self.world > 1:
            import torch.distributed as dist

            dist.broadcast(x, src)
        return x

    def all_gather_object(self, obj) -> list:
        """Every process's `obj`, in rank order (e.g. each one's share of a conversion, for one summary)."""
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj, src: int = 0):
        if self.world == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]
