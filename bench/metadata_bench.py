"""Metadata cost at a released model's tensor count, side by side in one run (bench only, not CI).

On a topology preset (`topo-k25`: Kimi-K2.5's 61 layers x 384 INT4 experts, ~210k stored tensors, at tiny
widths) it times, each as its own `kconvert` process as a user runs it:
  startup        `kconvert --version`: the CLI's own start-up, subtracted from every command below (least of the rounds)
  json floor     `json.loads` of every header (a plain Python process; least of the rounds): the least any reader can do
  read_header    kconvert's header reader (parse + every check) on the same files, in this process
  safetensors    safetensors' `safe_open` + keys + every shape: the library's own listing
  inspect, plan --tp T --quant fp8, shard --tp T (none; fp4, a copy of the experts' bytes, where the source stores
  them in FP4; fp8), verify-files (all, then --rank 1), load --rank 1
  (time to ready), pack --rank 1 (then unpack --rank 1: the directory as shard wrote it)
and prints wall seconds, seconds beyond start-up, microseconds per tensor and each command's own peak RSS (started
through bench/_cli.measured: not this process's, which built the fixtures), plus the size of kconvert.json and of
the per-rank tensor lists. inspect and plan report their best of --rounds runs, as start-up and the floor do.

Shard's per-tensor overhead is what the topology costs beyond its data and its fixed cost:
  data time    the same stored formats in a few large tensors (the preset at 16x its widths, 3 layers x 96
               experts: INT4 experts and BF16 rest for topo-k25, ~1,800 tensors of up to 4 MiB; same command),
               scaled to this checkpoint's tensor bytes (a BF16 baseline would leave INT4's 4x more values per
               byte to dequantize and re-quantize, and 4x more bytes to write for --quant none, in the overhead).
               It is not the topology's mix: at tiny widths the experts and the router (replicated on every rank)
               are a larger share of the bytes; the note prints the bytes each wrote (the data time's scaled)
               and the overhead with the data time scaled by bytes written instead (the truth lies between)
  fixed cost   torch's import and a run's set-up: the same command on a 2-layer, 8-expert copy of the preset
               (a few hundred tiny tensors), not scaled
Each process's CPU time is counted from outside, its exit included. The three shard commands run back to back,
`--rounds` times, and the median round is reported (a shared machine's speed drifts between minutes).

    .venv/bin/python bench/metadata_bench.py --work /tmp/kmeta                     # 61 x 384 (~2 minutes)
    .venv/bin/python bench/metadata_bench.py --work /tmp/kmeta --layers 11 --json  # a smaller run
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

from _cli import ENTRY, ROOT, compiled, fixture, measured  # first: this tree's kconvert on sys.path
from files_cost import files_cost

WIDE = {"widen": 16, "layers": 3, "experts": 96}  # the data-time checkpoint: same formats, large tensors
FIXED = {"widen": 1, "layers": 2, "experts": 8}  # shard's fixed cost: the same formats, hardly any tensors


def kconvert(*args, root: Path = ROOT) -> dict:
    """Run `kconvert ARGS` in a fresh process, from the tree at `root` (its own kconvert first on sys.path), through
    the console script's entry point: wall seconds, the process's own CPU seconds (all threads, its exit included)
    and peak RSS (bench/_cli.measured), its stdout."""
    r = measured([sys.executable, "-c", ENTRY, *args], cwd=root)
    if r["returncode"]:
        raise SystemExit(f"kconvert {' '.join(map(str, args))} failed ({r['returncode']}): {r['stderr'][-2000:]}")
    return {"wall": r["wall"], "rss": r["peak_rss"], "cpu": r["cpu"], "stdout": r["stdout"]}


def best_of(rounds: int, *args) -> dict:
    """The run of `kconvert ARGS` with the least CPU of `rounds` (the first also compiles the modules' bytecode after
    a fresh install; a shared machine's slow moments drop out)."""
    return min((kconvert(*args) for _ in range(rounds)), key=lambda r: r["cpu"])


def shard_round(root: Path, quant: str, tp: int, checkpoints: tuple[Path, Path, Path], out: Path, startup: float,
                scale: float) -> tuple[float, float, float, dict]:
    """One round of shard from the tree at `root`: this checkpoint (into `out`, kept), then the fixed-cost and the
    data-time ones, back to back. (CPU s beyond start-up, data and fixed cost, data time scaled by `scale`, this
    checkpoint's run)."""
    cpu = {}
    for name, ck in zip(("topo", "fixed", "big"), checkpoints):
        dest = out if name == "topo" else ck.with_name(f"{ck.name}-tp{tp}-{quant}")
        shutil.rmtree(dest, ignore_errors=True)
        cpu[name] = kconvert("shard", ck, dest, "--tp", tp, "--quant", quant, root=root)
        cpu[name]["written"] = sum(f.stat().st_size for f in dest.rglob("*.safetensors"))
        if name != "topo":
            shutil.rmtree(dest, ignore_errors=True)
    fixed, big = (cpu[k]["cpu"] - startup for k in ("fixed", "big"))
    data = fixed + (big - fixed) * scale  # scaled to this checkpoint's tensor bytes
    cpu["topo"]["reference_written"] = cpu["big"]["written"] * scale  # what the data time writes, scaled alike
    # the same data time scaled by the bytes each wrote instead: this checkpoint's mix writes more per source byte
    by_written = fixed + (big - fixed) * cpu["topo"]["written"] / cpu["big"]["written"]
    cpu["topo"]["beyond_by_written"] = cpu["topo"]["cpu"] - startup - by_written
    return cpu["topo"]["cpu"] - startup - data, data, fixed, cpu["topo"]


def written_tensors(out: Path) -> int:
    """Tensors a conversion wrote, every rank's (its kconvert.json)."""
    return sum(e["tensors"] for e in json.loads((out / "kconvert.json").read_text())["tensors_by_rank"])


def tensor_bytes(src: Path) -> int:
    """Bytes of tensor data in a checkpoint's files (headers aside: 208k entries make ~20 MB of them)."""
    total = 0
    for f in src.glob("*.safetensors"):
        with open(f, "rb") as fh:
            total += f.stat().st_size - 8 - struct.unpack("<Q", fh.read(8))[0]
    return total


def source(work: Path, preset: str, layers: int | None = None, experts: int | None = None) -> Path:
    """The checkpoint measured, in `work` (reused; named by its counts, L / E: the preset's own), built by
    `kconvert fixture` in a process of its own (not in this one, whose peak RSS the last line prints)."""
    src = work / f"{preset}-{layers or 'L'}-{experts or 'E'}"
    if not (src / "config.json").exists():
        kconvert("fixture", preset, src, *(["--layers", layers] if layers else []),
                 *(["--experts", experts] if experts else []))
    return src


def variant(preset: str, work: Path, v: dict) -> Path:
    """`preset` at v's widths and counts, in `work` (reused)."""
    return fixture(preset, work / f"{preset}-x{v['widen']}-{v['layers']}-{v['experts']}", layers=v["layers"],
                   experts=v["experts"], widen=v["widen"])


_FLOOR = """
import json, struct, sys, time
seconds, n = 0.0, 0
for f in sys.argv[1:]:
    with open(f, "rb") as fh:
        raw = fh.read(struct.unpack("<Q", fh.read(8))[0])
    t = time.process_time()
    n += len(json.loads(raw)) - 1  # __metadata__
    seconds += time.process_time() - t
print(seconds, n)
"""


def shard_quants(src: Path) -> tuple[str, ...]:
    """none and fp8 for every source; fp4 between them where the source stores its experts in FP4 (Kimi K3's MXFP4,
    DeepSeek-V4's e2m1): there `--quant fp4` copies their bytes, the cheapest conversion a user runs."""
    from kconvert.family.manifest import bind
    from kconvert.plan.device_presets import source_format

    config = json.loads((src / "config.json").read_text())
    own = source_format(bind(config).text_config, config)  # the family's manifest says where its text config is
    return ("none", "fp4", "fp8") if own == "fp4" else ("none", "fp8")


def json_floor(src: Path) -> tuple[float, int]:
    """json.loads of every header, the raw bytes already read, in a plain Python process of its own (in this one,
    torch's and the fixtures' objects would make every collection the parse triggers dearer): (CPU s, tensors)."""
    out = subprocess.run([sys.executable, "-c", _FLOOR, *map(str, sorted(src.glob("*.safetensors")))],
                         capture_output=True, text=True, check=True).stdout.split()
    return float(out[0]), int(out[1])


def json_bytes(src: Path) -> int:
    """The headers' JSON, every file's, in bytes: what inspect's and plan's peak RSS is measured against."""
    total = 0
    for f in sorted(src.glob("*.safetensors")):
        with open(f, "rb") as fh:
            total += struct.unpack("<Q", fh.read(8))[0]
    return total


def safetensors_listing(src: Path) -> float:
    import torch  # noqa: F401  (safe_open "pt" imports it: not part of the listing)
    from safetensors import safe_open

    t = time.perf_counter()
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(f, "pt") as h:
            for k in h.keys():
                h.get_slice(k).get_shape()
    return time.perf_counter() - t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True, help="Folder for the fixture and conversions (reused).")
    ap.add_argument("--preset", default="topo-k25")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--experts", type=int)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3, help="Rounds: inspect and plan report their best (least CPU); "
                    "shard rounds (each: this checkpoint, then the fixed-cost and data-time ones, back to back) their "
                    "median.")
    ap.add_argument("--json", action="store_true", help="Print the rows as JSON.")
    a = ap.parse_args(argv)
    a.work.mkdir(parents=True, exist_ok=True)
    compiled()
    src = source(a.work, a.preset, a.layers, a.experts)
    source_bytes = tensor_bytes(src)
    big, fixed_src = variant(a.preset, a.work, WIDE), variant(a.preset, a.work, FIXED)
    big_bytes = tensor_bytes(big)

    rows: list[dict] = []

    def row(name: str, r: dict, tensors: int, rss: int | None = None, note: str = "", base: dict | None = None):
        """wall and CPU seconds (CPU: of that process, all threads; robust on a shared machine), each beyond
        the CLI's start-up, and CPU microseconds per tensor."""
        base = startup if base is None else base
        beyond = r["cpu"] - base["cpu"]
        rows.append({"step": name, "wall": round(r["wall"], 2), "wall_beyond_startup": round(r["wall"] - base["wall"], 2),
                     "cpu": round(r["cpu"], 2), "cpu_beyond_startup": round(beyond, 2), "tensors": tensors,
                     "cpu_us_per_tensor": round(1e6 * beyond / max(tensors, 1), 1),
                     "peak_rss_mb": None if rss is None else round(rss / 2**20), "note": note})

    runs = [kconvert("--version") for _ in range(max(2, a.rounds))]
    startup = {k: min(r[k] for r in runs) for k in ("wall", "cpu")}
    floor, stored = min(json_floor(src) for _ in range(a.rounds))  # the least CPU, as for inspect and plan
    row("startup (kconvert --version)", startup, 0, base={"wall": 0.0, "cpu": 0.0})
    in_process = {"wall": 0.0, "cpu": 0.0}  # these two run in this process: nothing to subtract
    row("json.loads of the headers (floor)", {"wall": floor, "cpu": floor}, stored, base=in_process)
    from kconvert.io.safetensors_read import read_header

    t = time.perf_counter()
    for f in sorted(src.glob("*.safetensors")):
        read_header(f)
    reader = time.perf_counter() - t
    row("kconvert read_header, every file", {"wall": reader, "cpu": reader}, stored, base=in_process)
    listing = safetensors_listing(src)
    row("safetensors safe_open + keys + shapes", {"wall": listing, "cpu": listing}, stored, base=in_process)
    header_json = json_bytes(src)
    r = best_of(a.rounds, "inspect", src, "--json")
    row("inspect", r, stored, r["rss"], f"best of {a.rounds}; {(r['cpu'] - startup['cpu']) / floor:.2f}x the floor; "
        f"peak RSS {r['rss'] / header_json:.1f}x the headers' JSON ({header_json / 2**20:.1f} MiB)")
    weights = json.loads(r["stdout"])["tensors"]  # logical source tensors: a weight and its scales are one
    r = best_of(a.rounds, "plan", src, "--tp", a.tp, "--quant", "fp8", "--json")
    row(f"plan --tp {a.tp} --quant fp8", r, stored, r["rss"],
        f"best of {a.rounds}; {(r['cpu'] - startup['cpu']) / floor:.2f}x the floor; "
        f"peak RSS {r['rss'] / header_json:.1f}x the headers' JSON")
    out = {}
    for quant in shard_quants(src):
        out[quant] = a.work / f"{src.name}-tp{a.tp}-{quant}"
        rounds = [shard_round(ROOT, quant, a.tp, (src, fixed_src, big), out[quant], startup["cpu"], source_bytes / big_bytes)
                  for _ in range(a.rounds)]
        n_out = written_tensors(out[quant])
        fs, n_files = files_cost(out[quant])
        beyond, data, fixed, r = sorted(rounds, key=lambda x: x[0])[len(rounds) // 2]  # the median round
        row(f"shard --tp {a.tp} --quant {quant}", r, n_out, r["rss"],
            f"same formats and bytes in large tensors: {data:.1f} s CPU (fixed cost {fixed:.1f} s); beyond that: "
            f"{1e6 * beyond / n_out:.1f} us per written tensor, {1e6 * beyond / stored:.1f} per stored source tensor, "
            f"{1e6 * beyond / weights:.1f} per source weight "
            f"(median of {a.rounds} rounds: {', '.join(f'{1e6 * x[0] / n_out:.1f}' for x in rounds)}); the data time "
            f"is of {r['reference_written'] / 2**20:.0f} MiB written, scaled, where this run wrote "
            f"{r['written'] / 2**20:.0f} MiB: scaled by bytes written instead, "
            f"{1e6 * r['beyond_by_written'] / n_out:.1f} us per written tensor beyond it; creating its {n_files} files "
            f"(replayed: {1e6 * fs / n_files:.0f} us CPU a file) is {1e6 * fs / n_out:.1f} us per written tensor of the "
            f"overhead")
    fp8 = out["fp8"]
    files = json.loads((fp8 / "kconvert.json").read_text())["files"]
    r = kconvert("verify-files", fp8)
    row("verify-files (fp8)", r, n_out, r["rss"])
    r = kconvert("verify-files", fp8, "--rank", "1", "--json")
    mine = sum(1 for rec in files.values() if rec["rank"] == 1)
    row("verify-files --rank 1 (fp8)", r, n_out // a.tp, r["rss"],
        f"{json.loads(r['stdout'])['files']} of {len(files)} files: the rank's share (tensors: an even share)")
    assert json.loads(r["stdout"])["files"] == mine
    torch_import = min(measured([sys.executable, "-c", "import torch"])["wall"] for _ in range(max(2, a.rounds)))
    r = min((kconvert("load", fp8, "--rank", "1", "--device", "cpu", "--json") for _ in range(a.rounds)),
            key=lambda x: x["wall"])
    rep = json.loads(r["stdout"])
    budget = torch_import + 0.5 + rep["seconds"]["read"]
    row("load --rank 1 (fp8, cpu)", r, rep["tensors"], r["rss"],
        f"best of {a.rounds}; ready {rep['seconds']['ready']:.2f} s of which read {rep['seconds']['read']:.2f} s, "
        f"{rep['files']} files, {rep['bytes'] / 2**20:.1f} MiB; wall beyond start-up {r['wall'] - startup['wall']:.2f} s "
        f"vs torch's import {torch_import:.2f} s + 0.5 s + the read = {budget:.2f} s")
    r = kconvert("pack", fp8, "--rank", "1", "--json")  # then back: the directory stays as shard wrote it
    back = kconvert("unpack", fp8, "--rank", "1", "--json")
    packed = json.loads(r["stdout"])
    row("pack --rank 1 (fp8)", r, n_out // a.tp, r["rss"],
        f"{packed['files']} of {len(files)} files compressed, {rep['bytes'] / 2**20:.1f} MiB to "
        f"{packed['stored_bytes'] / 1e6:.1f} MB; "
        f"unpack --rank 1 {back['cpu'] - startup['cpu']:.2f} s CPU beyond start-up")
    lists = sorted(fp8.glob("rank-*/tensors.json"))
    sizes = {"kconvert.json": (fp8 / "kconvert.json").stat().st_size,
             "rank lists (all)": sum(p.stat().st_size for p in lists),
             "largest rank list": max(p.stat().st_size for p in lists), "files": len(files)}
    if a.json:
        print(json.dumps({"source": str(src), "stored_tensors": stored, "sizes": sizes, "rows": rows}, indent=1))
        return 0
    print(f"{src}: {stored} stored tensors, {source_bytes / 2**20:.0f} MiB of tensor data; converted tp {a.tp}: {n_out} tensors, "
          f"{sizes['files']} files")
    print("| step | wall s | wall − start-up | CPU s | CPU − start-up | tensors | CPU µs / tensor | peak RSS MB | note |")
    print("|---|---|---|---|---|---|---|---|---|")
    for x in rows:
        rss = x["peak_rss_mb"] if x["peak_rss_mb"] is not None else ""
        print(f"| {x['step']} | {x['wall']:.2f} | {x['wall_beyond_startup']:.2f} | {x['cpu']:.2f} | "
              f"{x['cpu_beyond_startup']:.2f} | {x['tensors']} | {x['cpu_us_per_tensor']:.1f} | {rss} | {x['note']} |")
    print(f"kconvert.json {sizes['kconvert.json'] / 2**20:.2f} MiB; per-rank tensor lists {sizes['rank lists (all)'] / 2**20:.2f} "
          f"MiB in all, the largest {sizes['largest rank list'] / 2**20:.2f} MiB (what load --rank reads)")
    print(f"(this process peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10:.0f} MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
