"""Kimi K3 at its real size (1.56 TB as released: 2.72T of its 2.78T parameters MXFP4 routed experts), `shard --tp 8`
for none / fp4 (copy) / fp8 / nvfp4, extrapolated from rates measured here (bench only, not CI; issue 57).

    time = max(CPU, disk)
    CPU  = source bytes / (processes x the per-core rate of that transcode) + written tensors x the per-tensor
           cost / processes
    disk = source bytes / read rate + bytes written / write rate      (one device does both)

The per-core rates (GB/s of source per CPU second: all of shard's work, its planning included) come from
bench/phases_bench.py's JSON (--phases), measured on its MXFP4 source (DeepSeek-V4 in V4-Flash's storage, experts at
bench widths, so their per-tensor work is in the rate too: conservative); fp4's from its bf16 `none` run: K3's fp4
keeps every tensor's bytes (MXFP4 experts, the BF16 rest), the byte copy's path; the bytes
written from `kconvert plan kimi-k3 --tp 8 --quant Q --json`; the tensors written and their cost beyond the data from
bench/metadata_bench.py on `topo-kimi-k3` (K3's 93 layers x 896 experts at tiny widths; docs/BENCHMARKS.md "Real
tensor counts"), given below as defaults; this disk's rate from bench/phases_bench.py's JSON (--phases: `cp -r` +
`sync` of the bf16 source, its bytes over its seconds; a cold read cannot be timed on this VM, so reads are taken
at the same rate). The NVMe node is stated, not measured: --nvme-read / --nvme-write GB/s and --nvme-processes.

    .venv/bin/python bench/k3_size.py --phases /tmp/kphases/phases.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

from _cli import KCONVERT_CMD, ROOT  # first: this tree's kconvert on sys.path

SOURCE_BYTES = 1.56e12  # Kimi K3 as released (the figure)
# (tensors written at tp 8, µs beyond the data per written tensor by source bytes): bench/metadata_bench.py --preset
# topo-kimi-k3, medians of 3 rounds (docs/BENCHMARKS.md "Real tensor counts"); nvfp4 was not timed there: fp8's
TENSORS = {"none": (267_120, 17.2), "fp4": (514_416, 12.6), "fp8": (523_136, 14.3), "nvfp4": (523_136, 14.3)}
PEERS = ("turboquant-mlx: K3's 1.56 TB in 25.7 min on one laptop (~1.0 GB/s; published); "
         "ModelOptStreaming: a 684B model in 10-15 min (self-reported)")


def plan_bytes(quant: str) -> int:
    r = subprocess.run([*KCONVERT_CMD, "plan", "kimi-k3", "--tp", "8", "--quant", quant, "--json"], cwd=ROOT,
                       capture_output=True, text=True, check=True)
    return json.loads(r.stdout)["converted_bytes"]


def minutes(s: float) -> str:
    return f"{s / 60:.1f} min"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phases", type=Path, required=True, help="bench/phases_bench.py --json output")
    ap.add_argument("--processes", type=int, default=2, help="this machine's cores (torchrun processes)")
    ap.add_argument("--nvme-read", type=float, default=7.0, help="GB/s, an assumed PCIe 4.0 x4 NVMe")
    ap.add_argument("--nvme-write", type=float, default=5.0, help="GB/s")
    ap.add_argument("--nvme-processes", type=int, default=16, help="torchrun processes on the NVMe node")
    a = ap.parse_args(argv)
    ph = json.loads(a.phases.read_text())
    none = ph["none"]
    runs = [s for s, _ in none["cli"]["runs"]["cp source"]] if "cli" in none else [none["cp_sync"]]
    rates = sorted(none["bytes_in"] / s / 1e9 for s in runs)
    disk = rates[len(rates) // 2]  # GB/s: cp -r + sync of the source, the median run
    print(f"this disk: {disk:.2f} GB/s (cp -r + sync of the {none['bytes_in'] / 1e9:.2f} GB source, the median of "
          f"{len(rates)} runs: {', '.join(f'{r:.2f}' for r in rates)} GB/s); NVMe node assumed: {a.nvme_read:g} GB/s "
          f"read, {a.nvme_write:g} GB/s write, {a.nvme_processes} processes\n")
    print("| K3 `shard --tp 8 --quant` | written | tensors | per core (GB/s of source) | this machine "
          f"({a.processes} processes): CPU / disk / total | NVMe node: CPU / disk / total |\n|---|---|---|---|---|---|")
    rows = {}
    for quant in ("none", "fp4", "fp8", "nvfp4"):
        # K3's fp4 keeps its MXFP4 experts and BF16 rest as bytes (convert/shard/byte_copy.py): the byte copy's rate,
        # measured on the bf16 `none` run; the others: the MXFP4 source, in one process
        run = ph["none"] if quant == "fp4" else ph[f"mxfp4-{quant}"]
        rate = run["bytes_in"] / run["cpu"] / 1e9  # CPU s of all its threads, planning and writing included (GB/s a core)
        out = plan_bytes(quant)
        n, us = TENSORS[quant]
        here_cpu = SOURCE_BYTES / 1e9 / (a.processes * rate) + n * us * 1e-6 / a.processes
        here_disk = SOURCE_BYTES / 1e9 / disk + out / 1e9 / disk
        nvme_cpu = SOURCE_BYTES / 1e9 / (a.nvme_processes * rate) + n * us * 1e-6 / a.nvme_processes
        nvme_disk = SOURCE_BYTES / 1e9 / a.nvme_read + out / 1e9 / a.nvme_write
        rows[quant] = {"rate": rate, "out": out, "here": max(here_cpu, here_disk), "nvme": max(nvme_cpu, nvme_disk)}
        print(f"| {quant} | {out / 1e12:.2f} TB | {n:,} | {rate:.2f} | {minutes(here_cpu)} / {minutes(here_disk)} / "
              f"**{minutes(max(here_cpu, here_disk))}** | {minutes(nvme_cpu)} / {minutes(nvme_disk)} / "
              f"**{minutes(max(nvme_cpu, nvme_disk))}** |")
    print(f"\npeers: {PEERS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
