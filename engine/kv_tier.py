"""Where latent pages live: device slots, and with a device budget a host tier plus a small device cache of
recently used host pages (filled row by row: a decode step copies only the rows DSA selected).

`Placement` (one per cache) maps a logical page to a device slot or a host slot and evicts the oldest
device page when the device budget is full; `Tier` (one per layer) holds that layer's bytes and does the
reads, writes and copies, counting every byte that crosses between host and device (`TierStats`). The
bytes are only moved, never recomputed: logits with the tier on equal logits with it off. On CPU both
sides are CPU memory, and the same code runs and counts."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from kconvert.errors import UsageError

PAGE = 64  # tokens per page, as FlashMLA pages its cache
HOT_SHARE = 4  # 1/HOT_SHARE of the device budget caches host pages; the rest holds the newest pages


@dataclass
class TierStats:
    fetched_bytes: int = 0  # host -> device, rows read for attention
    evicted_bytes: int = 0  # device -> host, pages moved out when the device budget is full
    host_write_bytes: int = 0  # new rows written straight to a host page (prefill beyond the budget)

    @property
    def moved_bytes(self) -> int:
        return self.fetched_bytes + self.evicted_bytes + self.host_write_bytes


def grow_rows(t: torch.Tensor, need: int, device, pin: bool = False) -> torch.Tensor:
    """t with at least `need` rows, growing by 1/4 (appends stay O(1) amortized, memory at most 25% over
    the tokens in use); zero-filled so padding rows read back as finite values."""
    if t.shape[0] >= need:
        return t
    new = torch.zeros(max(need, t.shape[0] + t.shape[0] // 4), t.shape[1], dtype=t.dtype, device=device)
    if pin:
        try:
            new = new.pin_memory()
        except RuntimeError:  # no page-locking on this build: plain host memory still works
            pass
    new[:t.shape[0]] = t
    return new


class Placement:
    def __init__(self, cache):
        self.cache, self.page = cache, PAGE
        self.stats = TierStats()
        self.dev_limit = self.hot_pages = None
        budget = cache.kv.device_budget
        if budget is not None:
            total = budget // (self.page * cache.latent_bytes_per_token)
            self.hot_pages = max(1, total // HOT_SHARE)
            self.dev_limit = total - self.hot_pages
            if self.dev_limit < 1:  # one resident page (rows may also be written straight to host pages)
                raise UsageError(f"--kv-device-budget {budget} B holds {total} latent page(s) of {PAGE} "
                                 "tokens: at least 2 are needed")
        self.where = torch.zeros(0, dtype=torch.long, device=cache.device)
        self.resident: OrderedDict[int, None] = OrderedDict()  # device pages, oldest first
        self.dev_free: list[int] = []
        self.host_free: list[int] = []
        self.dev_next = self.host_next = 0

    @property
    def tiered(self) -> bool:
        return self.dev_limit is not None

    def place(self, pid: int) -> None:
        """A new page goes to the device, moving the oldest device page to the host if the budget is full."""
        if self.dev_free:
            slot = self.dev_free.pop()
        elif self.dev_limit is None or self.dev_next < self.dev_limit:
            slot, self.dev_next = self.dev_next, self.dev_next + 1
        else:
            old, _ = self.resident.popitem(last=False)
            slot = int(self.where[old])
            host = self.host_free.pop() if self.host_free else self.host_next
            self.host_next = max(self.host_next, host + 1)
            for layer in self.cache.layers:
                layer.tier.move_to_host(slot, host)
            self.where[old] = -host - 1
        if self.where.shape[0] <= pid:
            self.where = grow_rows(self.where[:, None], pid + 1, self.cache.device)[:, 0]
        self.where[pid] = slot
        self.resident[pid] = None
        for layer in self.cache.layers:
            layer.tier.dev = grow_rows(layer.tier.dev, (slot + 1) * PAGE, self.cache.device)

    def free(self, pid: int) -> None:
        w = int(self.where[pid])
        if w >= 0:
            self.dev_free.append(w)
            self.resident.pop(pid, None)
        else:
            self.host_free.append(-w - 1)
        for layer in self.cache.layers:
            layer.tier.forget(pid)


class Tier:
    def __init__(self, cache, width: int):
        self.place, self.P, self.width = cache.placement, PAGE, width
        self.device = cache.device
        self.pin = cache.device.type != "cpu"
        self.dev = torch.zeros(0, width, dtype=torch.uint8, device=self.device)
        self.host = torch.zeros(0, width, dtype=torch.uint8)
        H = self.place.hot_pages or 0
        self.hot = torch.zeros(H * self.P, width, dtype=torch.uint8, device=self.device)
        self.hot_valid = torch.zeros(H, self.P, dtype=torch.bool, device=self.device)
        self.hot_of: dict[int, int] = {}
        self.hot_owner = [-1] * H
        self.last_use = [0] * H
        self.clock = 0

    def nbytes(self) -> int:
        return self.dev.numel() + self.host.numel() + self.hot.numel()

    def move_to_host(self, dev_slot: int, host_slot: int) -> None:
        P = self.P
        self.host = grow_rows(self.host, (host_slot + 1) * P, "cpu", self.pin)
        self.host[host_slot * P:(host_slot + 1) * P] = self.dev[dev_slot * P:(dev_slot + 1) * P].to("cpu")
        self.place.stats.evicted_bytes += P * self.width

    def forget(self, pid: int) -> None:
        s = self.hot_of.pop(pid, None)
        if s is not None:
            self.hot_owner[s] = -1
            self.hot_valid[s] = False

    def write(self, rows: torch.Tensor, data: torch.Tensor) -> None:
        """data [n, width] into logical rows [n]."""
        P = self.P
        pids, offs = rows // P, rows % P
        slot = self.place.where[pids]
        on_dev = slot >= 0
        if bool(on_dev.all()):
            self.dev[slot * P + offs] = data
            return
        self.dev[(slot * P + offs)[on_dev]] = data[on_dev]
        off_dev = ~on_dev
        for pid in torch.unique(pids[off_dev]).tolist():
            self.forget(pid)  # rows are rewritten after a truncation: cached copies are stale
        src = ((-slot - 1) * P + offs)[off_dev].cpu()
        self.host = grow_rows(self.host, int(src.max()) + 1, "cpu", self.pin)
        self.host[src] = data[off_dev].cpu()
        self.place.stats.host_write_bytes += int(off_dev.sum()) * self.width

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """Bytes [..., width] of logical rows [...], from wherever each row lives."""
        P = self.P
        slot = self.place.where[rows // P]
        if not self.place.tiered:
            return self.dev[slot * P + rows % P]
        on_dev = slot >= 0
        if bool(on_dev.all()):
            return self.dev[slot * P + rows % P]
        out = torch.empty(*rows.shape, self.width, dtype=torch.uint8, device=self.device)
        out[on_dev] = self.dev[(slot * P + rows % P)[on_dev]]
        off_dev = ~on_dev
        r = rows[off_dev]
        out[off_dev] = self._fetch(r // P, r % P, -slot[off_dev] - 1)
        return out

    def _fetch(self, pids, offs, host_slots) -> torch.Tensor:
        """Rows of host pages: through the hot cache when this step's pages fit in it, else read through."""
        P, stats = self.P, self.place.stats
        src = host_slots * P + offs
        pages = torch.unique(pids).tolist()
        if len(pages) > len(self.hot_owner):
            data = self.host[src.cpu()].to(self.device, non_blocking=True)
            stats.fetched_bytes += data.numel()
            return data
        self.clock += 1
        lut = torch.full((max(pages) + 1,), -1, dtype=torch.long)
        for pid in pages:
            s = self.hot_of.get(pid)
            if s is None:
                s = min((i for i in range(len(self.hot_owner)) if self.last_use[i] != self.clock),
                        key=self.last_use.__getitem__)
                if self.hot_owner[s] >= 0:
                    self.hot_of.pop(self.hot_owner[s])
                self.hot_owner[s], self.hot_of[pid] = pid, s
                self.hot_valid[s] = False
            self.last_use[s] = self.clock
            lut[pid] = s
        hs = lut.to(self.device)[pids]
        key = hs * P + offs
        need = ~self.hot_valid.view(-1)[key]
        if bool(need.any()):
            ukey, inv = torch.unique(key[need], return_inverse=True)
            first = torch.empty_like(ukey).scatter_(0, inv, torch.arange(inv.numel(), device=inv.device))
            rows = self.host[src[need][first].cpu()].to(self.device, non_blocking=True)
            self.hot[ukey] = rows
            self.hot_valid.view(-1)[ukey] = True
            stats.fetched_bytes += rows.numel()
        return self.hot[key]
