"""Where latent pages live: device slots, and with a device budget a host tier plus a small device cache of
recently used host pages (filled row by row: a decode step copies only the rows DSA selected).

`Placement` (one per cache) maps a logical page to a device slot or a host slot and evicts the oldest
device page when the device budget is full; `Tier` (one per layer) holds that layer's bytes and does the
reads, writes and copies, counting every byte that crosses between host and device (`TierStats`).

A layer's device tensor is [hot pages | resident slots]: the first `hot_pages` pages cache host pages, so
every read is one row gather from one tensor, whatever mix of resident, cached and just-fetched rows it
asks for. The cache's bookkeeping (which host page sits in which hot page, least recently used first,
which of its rows are valid) is tensors updated with vector ops: a decode step runs no Python loop over
pages and allocates nothing but its index vectors and the fetched rows. The bytes are only moved, never
recomputed: logits with the tier on equal logits with it off. On CPU both sides are CPU memory, and the
same code runs and counts."""

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
    new = torch.zeros(max(need, t.shape[0] + t.shape[0] // 4), *t.shape[1:], dtype=t.dtype, device=device)
    if pin:
        try:
            new = new.pin_memory()
        except RuntimeError:  # no page-locking on this build: plain host memory still works
            pass
    new[:t.shape[0]] = t
    return new


def take_rows(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """uint8 rows t[rows] ([..., width]), copied as the widest whole words the row width allows:
    index_select on 8-byte words is several times faster than indexing single bytes."""
    width = t.shape[1]
    word = next(w for w in (torch.int64, torch.int32, torch.int16, torch.uint8) if width % w.itemsize == 0)
    return t.view(word).index_select(0, rows.reshape(-1)).view(torch.uint8).view(*rows.shape, width)


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
        self.where = torch.zeros(0, dtype=torch.long, device=cache.device)  # >= 0 device slot, < 0: -1 - host slot
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
            for layer in self.cache.latent_layers:
                layer.tier.move_to_host(slot, host)
            self.where[old] = -host - 1
        if self.where.shape[0] <= pid:
            self.where = grow_rows(self.where, pid + 1, self.cache.device)
        self.where[pid] = slot
        self.resident[pid] = None
        for layer in self.cache.latent_layers:
            layer.tier.grow(slot)

    def free(self, pid: int) -> None:
        w = int(self.where[pid])
        if w >= 0:
            self.dev_free.append(w)
            self.resident.pop(pid, None)
        else:
            self.host_free.append(-w - 1)
        for layer in self.cache.latent_layers:
            layer.tier.forget(torch.tensor([pid], device=self.cache.device))


class Tier:
    def __init__(self, cache, width: int):
        self.place, self.P, self.width = cache.placement, PAGE, width
        self.device = cache.device
        self.pin = cache.device.type != "cpu"
        self.H = H = self.place.hot_pages or 0
        self.dev = torch.zeros(H * self.P, width, dtype=torch.uint8, device=self.device)  # [hot | resident]
        self.host = torch.zeros(0, width, dtype=torch.uint8)
        dev = self.device
        self.hot_of = torch.zeros(0, dtype=torch.long, device=dev)  # logical page -> hot page + 1 (0: none)
        self.hot_owner = torch.full((H,), -1, dtype=torch.long, device=dev)  # hot page -> logical page
        self.last_use = torch.zeros(H, dtype=torch.long, device=dev)  # step counter of the last read
        self.hot_valid = torch.zeros(H * self.P, dtype=torch.bool, device=dev)  # rows copied in so far
        self.clock = 0

    def nbytes(self) -> int:
        return self.dev.numel() + self.host.numel()

    def grow(self, slot: int) -> None:
        self.dev = grow_rows(self.dev, (self.H + slot + 1) * self.P, self.device)

    def move_to_host(self, dev_slot: int, host_slot: int) -> None:
        P, d0 = self.P, (self.H + dev_slot) * self.P
        self.host = grow_rows(self.host, (host_slot + 1) * P, "cpu", self.pin)
        self.host[host_slot * P:(host_slot + 1) * P] = self.dev[d0:d0 + P].to("cpu")
        self.place.stats.evicted_bytes += P * self.width

    def forget(self, pids: torch.Tensor) -> None:
        """Pages freed or rewritten: their cached copies are stale."""
        if self.H == 0 or self.hot_of.numel() == 0:
            return
        pids = pids[pids < self.hot_of.numel()]
        s = self.hot_of[pids] - 1
        s = s[s >= 0]
        self.hot_owner[s] = -1
        self.hot_valid.view(self.H, self.P)[s] = False
        self.hot_of[pids] = 0

    def _dev_rows(self, slot: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return (slot + self.H) * self.P + offs

    def write(self, rows: torch.Tensor, data: torch.Tensor) -> None:
        """data [n, width] into logical rows [n]."""
        P = self.P
        pids, offs = rows // P, rows % P
        slot = self.place.where[pids]
        on_dev = slot >= 0
        if not self.place.tiered or bool(on_dev.all()):
            self.dev[self._dev_rows(slot, offs)] = data
            return
        self.dev[self._dev_rows(slot, offs)[on_dev]] = data[on_dev]
        off_dev = ~on_dev
        self.forget(torch.unique(pids[off_dev]))  # rows are rewritten after a truncation: cached copies are stale
        src = ((-slot - 1) * P + offs)[off_dev].cpu()
        self.host = grow_rows(self.host, int(src.max()) + 1, "cpu", self.pin)
        self.host[src] = data[off_dev].cpu()
        self.place.stats.host_write_bytes += int(off_dev.sum()) * self.width

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """Bytes [..., width] of logical rows [...], from wherever each row lives."""
        P = self.P
        pids, offs = rows // P, rows % P
        slot = self.place.where[pids]
        if not self.place.tiered:
            return take_rows(self.dev, slot * P + offs)
        page = slot + self.H  # device page of every row: resident slots follow the hot pages
        host = slot < 0
        if bool(host.any()):
            hot = self._hot_pages(pids[host], offs[host], -slot[host] - 1)
            if hot is None:  # more host pages than the cache holds (prefill, dense attention): read through
                out = take_rows(self.dev, (page.clamp_min(0) * P + offs))
                out[host] = self._read_host(-slot[host] - 1, offs[host])
                return out
            page = page.masked_scatter(host, hot)
        return take_rows(self.dev, page * P + offs)

    def _read_host(self, host_slots: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        data = take_rows(self.host, (host_slots * self.P + offs).cpu()).to(self.device, non_blocking=True)
        self.place.stats.fetched_bytes += data.numel()
        return data

    def _hot_pages(self, pids, offs, host_slots) -> torch.Tensor | None:
        """The hot page of each host row [n] (its page cached, least recently used evicted, and its row copied
        in if not yet valid), or None when this step's host pages outnumber the cache."""
        P, H = self.P, self.H
        pages = torch.unique(pids)
        if pages.numel() > H:
            return None
        if self.hot_of.numel() < self.place.where.numel():
            self.hot_of = grow_rows(self.hot_of, self.place.where.numel(), self.device)
        self.clock += 1
        have = self.hot_of[pages] - 1
        self.last_use[have[have >= 0]] = self.clock  # this step's hits are the newest: never evicted now
        miss = pages[have < 0]
        if miss.numel():
            victims = torch.topk(self.last_use, miss.numel(), largest=False).indices  # least recently used
            old = self.hot_owner[victims]
            self.hot_of[old[old >= 0]] = 0
            self.hot_owner[victims] = miss
            self.hot_of[miss] = victims + 1
            self.last_use[victims] = self.clock
            self.hot_valid.view(H, P)[victims] = False
        hot = self.hot_of[pids] - 1
        key = hot * P + offs
        need = ~self.hot_valid[key]
        if bool(need.any()):  # copy in only the rows not cached yet, each once
            k, inv = torch.unique(key[need], return_inverse=True)
            src = torch.empty_like(k).scatter_(0, inv, host_slots[need])
            off = torch.empty_like(k).scatter_(0, inv, offs[need])
            self.dev[k] = self._read_host(src, off)
            self.hot_valid[k] = True
        return hot
