"""One prepared run of everything that needs an accelerator, for a machine lent for ~15 minutes.

    .venv/bin/python tools/device_check.py                     # the GPU (auto), full sizes: < 8 min on H100/H200
    .venv/bin/python tools/device_check.py --device cpu --quick   # CI: every step, tiny sizes
    .venv/bin/python tools/device_check.py --device standin --quick  # the GPU code paths on the stand-in

Builds what it needs under --workdir (no downloads): a `scale` checkpoint (--scale-size, tp 1), the
tiny-k25-dsv32 / small-k25-dsv32 fixtures (bf16) converted as-is and to fp8, and their references (transformers, CPU). Then:
  h2d        pinned and pageable host->device copy rate (the physical limit for loading)
  load       the scale conversion onto the device: kconvert.load vs safetensors load_file(device=)
             vs safe_open + .to(device); first read (page cache dropped with posix_fadvise) and warm;
             GB/s and the ratio to the pinned rate
  ready      `kconvert load --warmup 2` time-to-ready by phase (open, read, copy, load, warmup)
  verify     `kconvert verify` of the fixtures with the engine on the device (bf16 and fp8 conversions; V4's
             release storage, Kimi over V4 text and Kimi K3 (its KDA on the device, MLX's reference on the CPU)
             among them;
             the engine computes in fp32 there, as kconvert verify does everywhere). The step judges
             faithfulness, the device's engine against the fake-quantized source run on the CPU (a healthy
             machine agrees to round-off); the cost is reported, not judged: on these random-weight fixtures
             fp8 costs more than the budget set for trained weights (0.0475 mean KLD > 0.025 on a healthy CPU)
  decode     engine decode ms/token on the device (small-k25-dsv32, bf16) at each --contexts
  decode_v4  the same on DeepSeek-V4's layers (tiny-dsv4-flash dequantized: sliding / CSA / HCA, mHC, V4 cache)
  tp2        tiny-k25-dsv32 tp 2 over the device's collective backend, when >= 2 devices
Every step is timed and recorded; a step that fails or is skipped says why and the rest go on. Steps
that would start after --budget seconds are skipped. Writes one JSON (--out) and prints a table.
Over 300 lines on purpose: it is the one prepared script a lent machine runs in its few minutes, each
step a short function sharing the Run recorder and budget; read as one file, the whole device run can
be checked before the machine is spent (split, its steps would be read out of order).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1] / "bench"))  # bench/_cli.py, the helpers tools share
from _cli import ROOT, conversion, fixture  # noqa: E402  (first: this tree's kconvert on sys.path)

import torch  # noqa: E402

from kconvert import devices  # noqa: E402

PRELUDE = ("import sys\nif {standin}:\n    from kconvert.testing import standin; standin.install()\n"
           "from cli.main import main; sys.exit(main())")


class Run:
    """Records each step's result, or why it was skipped or failed, against a time budget."""

    def __init__(self, budget: float):
        self.t0, self.budget = time.perf_counter(), budget
        self.steps: dict[str, dict] = {}

    def step(self, name: str, fn, *args):
        if time.perf_counter() - self.t0 > self.budget:
            return self.skip(name, f"time budget of {self.budget:.0f} s spent")
        print(f"[{time.perf_counter() - self.t0:6.1f}s] {name} ...", flush=True)
        t = time.perf_counter()
        try:
            out = fn(*args)
        except Skip as e:
            return self.skip(name, str(e))
        except Exception as e:  # recorded: one broken step must not cost the rest of the machine time
            self.steps[name] = {"status": "failed", "error": f"{type(e).__name__}: {e}",
                                "trace": traceback.format_exc(limit=6), "seconds": time.perf_counter() - t}
            print(f"    FAILED: {type(e).__name__}: {e}", flush=True)
            return None
        self.steps[name] = {"status": "ok", "seconds": time.perf_counter() - t, **(out or {})}
        return out

    def skip(self, name: str, why: str):
        self.steps[name] = {"status": "skipped", "why": why}
        print(f"    skipped {name}: {why}", flush=True)


class Skip(Exception):
    pass


def sync(dev):
    devices.synchronize(dev)


# ------------------------------------------------------------------ steps


def env(dev) -> dict:
    mod = devices.module(dev) if dev.type != "cpu" else None
    name = getattr(mod, "get_device_name", lambda d: "")(dev) if mod else platform.processor() or "cpu"
    return {"torch": torch.__version__, "device": str(dev), "device_name": name,
            "device_count": devices.count(dev.type) if mod else 0, "cpus": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def h2d(dev, nbytes: int) -> dict:
    if dev.type == "cpu":
        raise Skip("no host-to-device copy on cpu")
    out = {}
    for kind, host in (("pinned", devices.pinned_empty(nbytes)), ("pageable", torch.empty(nbytes, dtype=torch.uint8))):
        dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        dst.copy_(host, non_blocking=True)
        sync(dev)
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            dst.copy_(host, non_blocking=True)
            sync(dev)
            best = min(best, time.perf_counter() - t)
        out[f"{kind}_GBps"] = nbytes / best / 1e9
        del dst
    return out


def build(work: Path, scale_size: int, fixtures: list[str], steps: set[str], n_devices: int) -> dict:
    from kconvert.verify.prompts import prompts_for
    from kconvert.verify.reference import run_reference

    built = {}  # each built once into `work` (bench/_cli.py): a later run reuses it
    src = fixture("scale", work / "scale-src", size=scale_size)
    built["scale"] = conversion(src, work / "scale-conv", workers=2)
    for fx in fixtures:  # bf16 source: verified as converted (none) and quantized (fp8)
        src = built[f"{fx}-src"] = fixture(fx, work / f"{fx}-src")
        for quant in ("none", "fp8") if "verify" in steps else ("none",):
            built[f"{fx}-{quant}"] = conversion(src, work / f"{fx}-{quant}-conv", quant=quant)
        ref = work / f"{fx}.ref.safetensors"
        if "verify" in steps and not ref.exists():
            run_reference(str(src), ref, prompts_for(json.loads((src / "config.json").read_text())))
        built[f"{fx}-ref"] = ref
    if "tp2" in steps and n_devices >= 2:
        built["tiny-k25-dsv32-tp2"] = conversion(work / "tiny-k25-dsv32-src", work / "tiny-k25-dsv32-tp2-conv", tp=2,
                                                 quant="fp8")
    return {"built": {k: str(v) for k, v in built.items()}, "paths": built}


def drop_cache(files) -> None:
    """Evict the files from the page cache (no root needed): the next read comes from the disk."""
    os.sync()  # dirty pages (a conversion just written) cannot be dropped
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def load(dev, conv_dir: Path, pinned_GBps: float | None) -> dict:
    from safetensors import safe_open
    from safetensors.torch import load_file

    from kconvert.load.loader import open_converted

    files = sorted(conv_dir.glob("rank-000/*.safetensors"))
    total = sum(f.stat().st_size for f in files)
    where = str(dev) if dev.type != "cpu" else "cpu"

    def kconvert():
        return dict(open_converted(conv_dir).stream(dev, prefetch=2))

    def st_load_file():
        return {f: load_file(f, device=where) for f in files}

    def st_safe_open():
        held = {}
        for f in files:
            with safe_open(f, "pt") as h:
                for k in h.keys():
                    held[k] = h.get_tensor(k).to(dev)
        return held

    rows = {}
    for name, fn in (("kconvert", kconvert), ("load_file", st_load_file), ("safe_open+to", st_safe_open)):
        for when in ("first", "warm"):
            if when == "first":
                drop_cache(files)
            t = time.perf_counter()
            try:
                held = fn()
                sync(dev)
            except Exception as e:  # e.g. safetensors does not know this device type
                rows[f"{name}/{when}"] = {"error": f"{type(e).__name__}: {e}"}
                break
            s = time.perf_counter() - t
            del held
            rows[f"{name}/{when}"] = {"seconds": s, "GBps": total / s / 1e9,
                                      "x_pinned": total / s / 1e9 / pinned_GBps if pinned_GBps else None}
    warm = {k.split("/")[0]: v.get("seconds") for k, v in rows.items() if k.endswith("warm")}
    ratio = warm["load_file"] / warm["kconvert"] if warm.get("load_file") and warm.get("kconvert") else None
    return {"bytes": total, "rows": rows, "kconvert_vs_load_file_warm": ratio}


def ready(dev, conv_dir: Path) -> dict:
    code = PRELUDE.format(standin=dev.type == "standin")
    r = subprocess.run([sys.executable, "-c", code, "load", str(conv_dir), "--device", str(dev), "--warmup", "2",
                        "--json"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    if r.returncode:
        raise RuntimeError(r.stderr.strip()[-500:])
    rep = json.loads(r.stdout)
    return {"phases": rep["seconds"], "GBps": rep["GBps"], "peak_device_bytes": rep["peak_device_bytes"]}


def verify(dev, paths: dict, fixtures: list[str]) -> dict:
    from kconvert.verify.verdict import run_verify

    out = {}
    for fx in fixtures:
        for quant in ("none", "fp8"):
            src = paths.get(f"{fx}-src")
            rep = run_verify(str(paths[f"{fx}-{quant}"]), reference=str(paths[f"{fx}-ref"]), device=str(dev),
                             against=str(src) if src else None)
            faith = rep.faithfulness
            out[f"{fx}-{quant}"] = {"verdict": faith.verdict, "verify": rep.verdict, "faithful": faith.overall,
                                    "cost": rep.cost.overall, "cost_verdict": rep.cost.verdict,
                                    "failures": faith.failures or ([faith.reference] if faith.verdict != "PASS" else []),
                                    "seconds": rep.seconds}
    # faithfulness decides (a SKIPPED one judged nothing: a FAIL here); the cost is a fact of random weights
    failed = any(v["verdict"] != "PASS" for v in out.values())
    return {"status": "FAIL" if failed else "ok", "judged": "faithfulness (device vs the CPU reference); cost "
            "reported", "compute_dtype": "float32 (the dtype kconvert verify's engine computes in)", "fixtures": out}


def decode(dev, conv_dir: Path, contexts: list[int], steps: int) -> dict:
    from engine.model import Model

    model = Model.from_converted(conv_dir, device=dev, dtype=torch.bfloat16)
    out = {}
    for ctx in contexts:
        ctx = min(ctx, model.cfg.max_position_embeddings - steps - 2)
        ids = torch.randint(0, model.cfg.vocab_size, (1, ctx), generator=torch.Generator().manual_seed(ctx))
        cache = model.new_cache(1, ctx + steps + 1)
        for s in range(0, ctx, 512):
            model.forward(ids[:, s:s + 512], cache, last_only=True)
        tok = torch.tensor([[1]])
        model.forward(tok, cache, last_only=True)
        sync(dev)
        t = time.perf_counter()
        for _ in range(steps):
            model.forward(tok, cache, last_only=True)
        sync(dev)
        out[str(ctx)] = {"ms_per_token": (time.perf_counter() - t) / steps * 1000}
    return {"dtype": "bfloat16", "contexts": out}


def tp2(dev, conv_dir: Path, work: Path) -> dict:
    if dev.type == "cpu" or devices.count(dev.type) < 2:
        raise Skip(f"needs 2 {dev.type} devices, this machine has {devices.count(dev.type) if dev.type != 'cpu' else 0}")
    try:
        backend = devices.collective_backend(dev)
    except Exception as e:
        raise Skip(str(e)) from None
    save = work / "tp2-logits.pt"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "engine.runtime.tp_check",
                        str(conv_dir), "--device", dev.type, "--save", str(save)], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    if r.returncode:
        errors = [l for l in r.stderr.splitlines() if "Error" in l and "elastic" not in l]
        raise RuntimeError((errors or r.stderr.strip().splitlines() or ["no output"])[-1][-500:])
    return {"backend": backend, "logits_saved": str(save)}


# ------------------------------------------------------------------ report


def table(steps: dict) -> str:
    lines = [f"{'step':<10} {'status':<8} {'seconds':>8}  result"]
    for name, s in steps.items():
        if s["status"] not in ("ok", "FAIL"):  # skipped or failed: nothing measured
            lines.append(f"{name:<10} {s['status']:<8} {'':>8}  {s.get('why') or s.get('error')}")
            continue
        if name == "h2d":
            res = f"pinned {s['pinned_GBps']:.2f} GB/s, pageable {s['pageable_GBps']:.2f} GB/s"
        elif name == "load":
            res = f"{s['bytes'] / 1e9:.2f} GB; " + "; ".join(
                f"{k} {v['error']}" if "error" in v else
                f"{k} {v['GBps']:.2f} GB/s" + (f" ({v['x_pinned']:.2f}x pinned)" if v["x_pinned"] else "")
                for k, v in s["rows"].items())
            if s["kconvert_vs_load_file_warm"]:
                res += f"; kconvert/load_file warm {s['kconvert_vs_load_file_warm']:.2f}x"
        elif name == "ready":
            res = ", ".join(f"{k} {v:.2f}s" for k, v in s["phases"].items())
        elif name == "verify":
            res = "; ".join(f"{fx} faithful {v['verdict']} (mean KLD {v['faithful'].get('mean_kld', float('nan')):.2e}; "
                            f"cost {v['cost'].get('mean_kld', float('nan')):.2e}, {v.get('cost_verdict', '-')} on its "
                            "budget, not judged)" for fx, v in s["fixtures"].items())
        elif name in ("decode", "decode_v4"):
            res = ", ".join(f"{c} ctx {v['ms_per_token']:.1f} ms/token" for c, v in s["contexts"].items())
        else:
            res = ", ".join(f"{k} {v}" for k, v in s.items() if k not in ("status", "seconds", "paths"))[:160]
        lines.append(f"{name:<10} {s['status']:<8} {s['seconds']:>8.1f}  {res}")
    return "\n".join(lines)


def parse_size(s: str) -> int:
    units = {"k": 2**10, "m": 2**20, "g": 2**30}
    s = s.strip().lower().rstrip("b")
    return int(float(s[:-1]) * units[s[-1]]) if s[-1] in units else int(s)


def default_workdir(scale: int, fixtures: list[str]) -> Path:
    """The build folder for these sizes under the system temp directory: a --quick run never reuses (or is
    taken for) a full-size build, and runs of other sizes keep their own."""
    import tempfile

    return Path(tempfile.gettempdir()) / f"kconvert-device-check-scale{scale}-{'+'.join(fixtures)}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda[:i], musa[:i], standin")
    ap.add_argument("--quick", action="store_true", help="CI sizes: 8 MB scale, tiny fixtures, short contexts")
    ap.add_argument("--workdir", help="built checkpoints, reused if present (default: one per --scale-size and "
                    "fixture set under the system temp directory)")
    ap.add_argument("--out", help="JSON report (default: WORKDIR/device_check-DEVICE-TIME-PID.json, one per run)")
    ap.add_argument("--scale-size", help="scale checkpoint size (default 4GB; --quick 8MB)")
    ap.add_argument("--contexts", help="decode contexts in tokens (default 1024,4096; --quick 32,64)")
    ap.add_argument("--budget", type=float, default=420, help="seconds after which remaining steps are skipped")
    ap.add_argument("--skip", default="", help="comma-separated steps to leave out")
    ap.add_argument("--fixtures", help="comma-separated fixture presets verified on the device (default tiny-k25-dsv32, small-k25-dsv32, "
                    "tiny-dsv4-flash: DeepSeek-V4's release storage, tiny-k25-dsv4: Kimi over V4 text, tiny-kimi-k3: Kimi K3's "
                    "KDA / MLA / MXFP4 against MLX; --quick: tiny-k25-dsv32)")
    a = ap.parse_args(argv)
    if a.device.startswith("standin"):
        from kconvert.testing import standin

        standin.install()
    dev = devices.resolve(a.device)
    scale = parse_size(a.scale_size or ("8MB" if a.quick else "4GB"))
    contexts = [int(c) for c in (a.contexts or ("32,64" if a.quick else "1024,4096")).split(",")]
    fixtures = (a.fixtures.split(",") if a.fixtures else
                ["tiny-k25-dsv32"] + ([] if a.quick else ["small-k25-dsv32", "tiny-dsv4-flash", "tiny-k25-dsv4",
                                                          "tiny-kimi-k3"]))
    work = Path(a.workdir) if a.workdir else default_workdir(scale, fixtures)
    work.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, a.skip.split(",")))
    run = Run(a.budget)
    run.step("env", env, dev)
    pinned = run.step("h2d", h2d, dev, min(scale, 1 << 30)) if "h2d" not in skip else None
    wanted = {"load", "ready", "verify", "decode", "decode_v4", "tp2"} - skip
    b = run.step("build", build, work, scale, fixtures, wanted, devices.count(dev.type) if dev.type != "cpu" else 0)
    if b is None:
        print("build failed: nothing else can run", file=sys.stderr)
    else:
        paths = b.pop("paths")
        plan = [("load", load, dev, paths["scale"], (pinned or {}).get("pinned_GBps")),
                ("ready", ready, dev, paths["scale"]),
                ("verify", verify, dev, paths, fixtures),
                ("decode", decode, dev, paths["small-k25-dsv32-none" if "small-k25-dsv32-none" in paths else "tiny-k25-dsv32-none"], contexts,
                 2 if a.quick else 16),
                ("decode_v4", decode, dev, paths.get("tiny-dsv4-flash-none"), contexts, 2 if a.quick else 16),
                ("tp2", tp2, dev, paths.get("tiny-k25-dsv32-tp2"), work)]
        for name, fn, *args in plan:
            if name == "decode_v4" and args[1] is None:
                run.skip(name, "tiny-dsv4-flash is not among --fixtures")
                continue
            run.skip(name, "--skip") if name in skip else run.step(name, fn, *args)
    report = {"device": str(dev), "quick": a.quick, "scale_bytes": scale, "total_seconds": time.perf_counter() - run.t0,
              "steps": run.steps}
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(a.out or work / f"device_check-{str(dev).replace(':', '')}-{stamp}-{os.getpid()}.json")
    out.write_text(json.dumps(report, indent=2, default=str))
    print(table(run.steps))
    print(f"wrote {out} ({report['total_seconds']:.0f} s)")
    left = {k: v.get("why") or v.get("error") for k, v in run.steps.items() if v["status"] not in ("ok", "FAIL")}
    for k, why in left.items():
        print(f"not measured: {k}: {why}")
    for k in (k for k, v in run.steps.items() if v["status"] == "FAIL"):
        print(f"FAIL: {k}: " + "; ".join(f for v in run.steps[k]["fixtures"].values() for f in v["failures"])[:300])
    return 1 if any(v["status"] in ("failed", "FAIL") for v in run.steps.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
