"""Time-to-ready of one rank (`kconvert load`): open the conversion, stream the rank's units onto a device
(into the engine as they arrive, with `warmup`), run warmup forward passes, and report each phase.

With warmup the run is the model's: every rank of the conversion's tp x pp layout must be running (torchrun
or engine.runtime.launch) and each builds its own share. Without it the units are only read and held, as an
engine would hold them, so the peak memory is a real one."""

from __future__ import annotations

import os
import time
from typing import Callable

import torch

from kconvert import devices
from kconvert.distributed import Group
from kconvert.host_memory import peak_rss_bytes
from kconvert.io.gc_pause import frozen_gc
from kconvert.load.loader import open_converted

Progress = Callable[..., None]  # progress("phase", name=) / ("start", total=bytes) / ("advance", n=bytes) / ("file", path=unit)


# torch's and the CLI's objects, alive before the load, out of the walks of the collections its tensors and views
# make: at Kimi K3's topology (65k tensors a rank) those walks were a third of the time to ready
@frozen_gc()
def load_rank(out, *, rank: int | None = None, stage: int | None = None, tp_rank: int | None = None,
              world_size: int | None = None, device: str = "auto", verify: bool = False, prefetch: int = 2,
              threads: int = 4, warmup: int = 0, kv_dtype: str | None = None, kv_budget: str | None = None,
              kv_device_budget: str | None = None, progress: Progress | None = None) -> dict:
    """The phase report of loading one rank: {out, rank, stage, tp_rank, world_size, pp, device, files, bytes,
    tensors, seconds: {start_ranks, open, load, read, verify, copy, warmup, ready}, GBps, peak_host_rss_bytes,
    peak_device_bytes, verified, kv}. With warmup > 0 the rank is the launched process's (RANK), not `rank`, and
    `start_ranks` is the wait for every rank to join (their start-up), apart from `open`."""
    progress = progress or (lambda *a, **k: None)
    t0 = time.perf_counter()
    dev = devices.resolve(device)
    if dev.type != "cpu" and "LOCAL_RANK" in os.environ:  # one accelerator per torchrun process
        dev = devices.resolve(f"{dev.type}:{os.environ['LOCAL_RANK']}")
    par, t_ranks = None, 0.0
    if warmup:
        progress("phase", name="start ranks")
        par = Group.from_env(dev)  # returns once every rank has joined: their start-up, not this rank's open
        rank, world_size = par.rank, par.world  # checked against the conversion's layout by open_converted
        t_ranks = time.perf_counter() - t0
    t0 = time.perf_counter()
    conv = open_converted(out, rank=rank, world_size=world_size, stage=stage, tp_rank=tp_rank)
    model = None
    if warmup:
        from engine.cache.budget import kv_options
        from engine.model import Model

        kv = kv_options(kv_dtype, kv_budget, kv_device_budget, dev)
        model = Model.for_rank(conv, par, dev, torch.bfloat16)  # holds no weights until units arrive
        model.kv = kv
    t_open = time.perf_counter() - t0
    t1 = time.perf_counter()
    held, tensors = [], 0
    progress("phase", name=f"load rank {conv.rank} → {dev}")
    progress("start", total=conv.total_bytes)
    check = verify or ("first" if model is not None else False)  # --warmup serves what it loads: CRCs once
    for unit, unit_tensors in conv.stream(dev, prefetch=prefetch, verify=check, threads=threads):
        tensors += len(unit_tensors)
        if model is not None:
            model.take_unit(unit, unit_tensors)  # each layer's modules filled as its tensors arrive
        else:
            held.append(unit_tensors)  # keep them, as an engine would
        progress("advance", n=conv.files[str(conv.file_of(unit).relative_to(conv.root))]["bytes"])
        progress("file", path=unit)
    devices.synchronize(dev)
    t_load = time.perf_counter() - t1
    t_warm = 0.0
    if model is not None:
        model.check_complete()
        t2 = time.perf_counter()
        ids = torch.arange(32).remainder(model.cfg.vocab_size)[None]
        for _ in range(warmup):
            model.forward(ids, last_only=True)
        devices.synchronize(dev)
        t_warm = time.perf_counter() - t2
    if par is not None:
        par.close()
    s = conv.stats
    return {
        "out": str(out), "rank": conv.rank, "stage": conv.stage, "tp_rank": conv.tp_rank,
        "world_size": conv.world_size, "pp": conv.pp, "device": str(dev), "files": s.files, "bytes": s.bytes,
        "tensors": tensors,
        "seconds": {"start_ranks": t_ranks, "open": t_open, "load": t_load, "read": s.read_seconds,
                    "verify": s.verify_seconds, "copy": s.copy_seconds, "warmup": t_warm,
                    "ready": t_ranks + t_open + t_load + t_warm},
        "GBps": s.bytes / t_load / 1e9 if t_load else 0.0,
        "peak_host_rss_bytes": peak_rss_bytes(),
        "peak_device_bytes": devices.memory_allocated_peak(dev),
        "verified": verify,
        "kv": {"dtype": kv_dtype, "budget": kv_budget, "device_budget": kv_device_budget} if warmup else None,
    }
