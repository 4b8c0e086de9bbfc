"""The host's memory as a run sees it: what is available to size worker pools by, and this process's own peak."""

from __future__ import annotations

import os
import resource


def available_memory() -> int:
    """Bytes the kernel says can be allocated without swapping (MemAvailable); half of RAM where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def peak_rss_bytes() -> int:
    """This process's peak resident memory. Linux's ru_maxrss also counts what the parent held when it started
    this process (it is carried over fork and exec: a shard started from a 2 GB Python process reports at least
    2 GB); VmHWM is this address space's own high-water mark. ru_maxrss where /proc is absent."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
