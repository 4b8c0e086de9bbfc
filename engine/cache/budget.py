"""KV options from the command line: `--kv-dtype`, `--kv-budget` and `--kv-device-budget` as byte counts
("8GiB", "512M", "1000000") or, below 1, a fraction of the device's free memory ("0.9")."""

from __future__ import annotations

import os
import re

import torch

from engine.cache.latent import KVOptions
from engine.cache.row_format import check_kv_dtype
from kconvert.arguments import byte_count
from kconvert.errors import UsageError

UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2 ** 10, "mi": 2 ** 20, "gi": 2 ** 30, "ti": 2 ** 40}


def free_memory(device) -> int:
    """Free bytes on `device` (host RAM available for cpu)."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    from kconvert.load.devices import module

    info = getattr(module(dev), "mem_get_info", None)
    if info is None:
        raise UsageError(f"{dev.type} does not report its free memory: give the KV budget in bytes")
    return int(info(dev)[0])


def parse_budget(text: str | None, option: str, device="cpu") -> int | None:
    if text is None:
        return None
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?)?b?\s*", str(text).lower(), re.ASCII)
    if not m or len(m.group(1)) > 32:
        raise UsageError(f"{option} {text!r}: give bytes (8GiB, 512M) or a fraction of free memory (0.9)")
    value, unit = float(m.group(1)), m.group(2) or ""
    if not unit and 0 < value < 1:
        return int(value * free_memory(device))
    return byte_count(value * UNITS[unit], option, text)  # positive, and at most 1 EiB (1e30 crashed torch)


def kv_options(kv_dtype: str | None = None, budget: str | None = None, device_budget: str | None = None,
               device="cpu") -> KVOptions:
    return KVOptions(check_kv_dtype(kv_dtype), parse_budget(budget, "--kv-budget", device),
                     parse_budget(device_budget, "--kv-device-budget", device))
