"""Fingerprint what conversions produce, to prove a refactor changed no byte and no logit.

For every model preset it builds the fixture, runs `shard` (each --quant, several layouts) and `export`
(each format) through the CLI in this process, and records the sha256 of every output file, plus the
engine's logits (raw float bytes) on one prompt for a few conversions. Run it on two commits and diff:

    .venv/bin/python tools/identity_check.py --out /tmp/before.json     # on the old commit
    .venv/bin/python tools/identity_check.py --out /tmp/after.json      # on the new one
    .venv/bin/python tools/identity_check.py --diff /tmp/before.json /tmp/after.json
    .venv/bin/python tools/identity_check.py --presets topo-k25,topo-dsv4-pro --layers 3 --experts 32 --out X.json

Paths are not part of the fingerprint (JSON files have the work folder and kconvert.json's digest masked).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # the helpers tools share with the benchmarks
from _cli import in_process  # noqa: E402 (first: this tree's kconvert, not whichever one the venv installed)

PRESETS = ("tiny-k25-dsv32", "tiny-dsv32", "tiny-k25-dsv32-fp8", "tiny-k25-dsv32-int4", "tiny-k25-dsv32-4l", "tiny-dsv32-4l")
SHARDS = (
    ("tp1-none", ["--tp", "1"]),
    ("tp2-none", ["--tp", "2"]),
    ("tp2-fp8", ["--tp", "2", "--quant", "fp8"]),
    ("tp2-fp8-ue8m0", ["--tp", "2", "--quant", "fp8", "--scale-format", "ue8m0"]),
    ("tp2-int8", ["--tp", "2", "--quant", "int8"]),
    ("tp2-int4", ["--tp", "2", "--quant", "int4"]),
    ("tp2-int4-amax-g64", ["--tp", "2", "--quant", "int4", "--int4-scales", "amax", "--group-size", "64"]),
    ("tp4-ep2-fp8", ["--tp", "4", "--ep", "2", "--quant", "fp8"]),
    ("tp1-pp2-fp8", ["--tp", "1", "--pp", "2", "--quant", "fp8"]),
    ("tp2-int8-keep", ["--tp", "2", "--quant", "int8", "--keep", "*q_b_proj*", "--quantize", "*shared_experts*"]),
    ("tp1-fp8", ["--tp", "1", "--quant", "fp8"]),
    ("tp1-int8", ["--tp", "1", "--quant", "int8"]),
    ("tp1-int4", ["--tp", "1", "--quant", "int4"]),
)
EXPORTS = (("fp8-block", []), ("w4a16", []), ("w8a8-int8", []), ("fp8-channel", []),
           ("fp8-block-ue8m0", ["--scale-format", "ue8m0"]))
LOGITS = ("tp1-none", "tp1-fp8", "tp1-int4", "tp1-int8")  # one process: tp 1 conversions


def run_cli(args: list[str]) -> int | str:
    r = in_process(*args)
    if r.returncode == 0:
        return 0
    # a refusal is part of the fingerprint: its exit code and message, without the work folder
    return f"{r.returncode}: {r.stderr.strip()}".replace(str(Path(args[2]).parent), "<work>")


def digest(folder: Path) -> dict:
    """sha256 per file. JSON files name the source's folder (and kconvert.json digests itself with it):
    those two are masked, every other byte counts."""
    files = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            data = p.read_bytes()
            if p.suffix == ".json":
                text = data.decode().replace(str(folder.parent), "<work>")
                data = re.sub(r'"digest": "sha256:[0-9a-f]+"', '"digest": "<masked>"', text).encode()
            files[str(p.relative_to(folder))] = hashlib.sha256(data).hexdigest()
    return files


def logits_digest(conv: Path, dtype: str = "float32") -> str:
    import torch

    from engine.model import Model

    model = Model.from_converted(conv, dtype=getattr(torch, dtype))
    ids = torch.tensor([[1, 5, 9, 17, 33, 65, 129, 200, 7, 3, 11, 42]])
    with torch.no_grad():
        logits = model.forward(ids)
    return hashlib.sha256(logits.float().contiguous().numpy().tobytes()).hexdigest()


def fingerprint(work: Path, presets, with_logits: bool, sizes: dict | None = None) -> dict:
    """`sizes` ({"layers": N, "experts": E}): the topology presets' overrides (a release's tensor layout at a size
    a run can afford; the other presets have one size)."""
    import torch

    from kconvert.fixtures import build_fixture

    torch.set_num_threads(2)
    result = {}
    for preset in presets:
        src = build_fixture(preset, work / preset, **((sizes or {}) if preset.startswith("topo-") else {}))
        result[f"{preset}/source"] = digest(src)
        for tag, args in SHARDS:
            out = work / f"{preset}.{tag}"
            code = run_cli(["shard", str(src), str(out), *args])
            result[f"{preset}/shard/{tag}"] = {"exit": code, **(digest(out) if out.exists() else {})}
            if with_logits and code == 0 and tag in LOGITS:
                for dtype, key in (("float32", tag), ("bfloat16", f"{tag}-bf16")):  # verify's and chat's
                    try:
                        result[f"{preset}/logits/{key}"] = logits_digest(out, dtype)
                    except Exception as e:  # noqa: BLE001
                        result[f"{preset}/logits/{key}"] = f"error {type(e).__name__}"
            shutil.rmtree(out, ignore_errors=True)
        for tag, args in EXPORTS:
            out = work / f"{preset}.export.{tag}"
            fmt = tag.replace("-ue8m0", "")
            code = run_cli(["export", str(src), str(out), "--format", fmt, *args])
            result[f"{preset}/export/{tag}"] = {"exit": code, **(digest(out) if out.exists() else {})}
            shutil.rmtree(out, ignore_errors=True)
        print(f"{preset}: done", file=sys.stderr, flush=True)
    return result


def diff(a: dict, b: dict) -> int:
    """Entries of the presets `b` covers (a run with --presets compares against a full one)."""
    bad = 0
    presets = {k.split("/")[0] for k in b}
    missing = sorted({k.split("/")[0] for k in a} - presets)
    if missing:
        print(f"not in the second run: {', '.join(missing)}")
    for key in sorted(k for k in set(a) | set(b) if k.split("/")[0] in presets):
        if a.get(key) != b.get(key):
            bad += 1
            print(f"DIFFERS {key}")
            if isinstance(a.get(key), dict) and isinstance(b.get(key), dict):
                for f in sorted(set(a[key]) | set(b[key])):
                    if a[key].get(f) != b[key].get(f):
                        print(f"    {f}: {a[key].get(f)} -> {b[key].get(f)}")
    n_files = sum(len(v) - 1 for k, v in b.items() if isinstance(v, dict) and "exit" in v)
    print(f"{len(b)} entries ({n_files} output files), {bad} differ")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--no-logits", action="store_true")
    ap.add_argument("--diff", nargs=2, type=Path)
    ap.add_argument("--layers", type=int, help="topo-* presets: decoder layers (e.g. 3 for topo-k25: 2 MoE layers)")
    ap.add_argument("--experts", type=int, help="topo-* presets: routed experts")
    a = ap.parse_args()
    if a.diff:
        return diff(json.loads(a.diff[0].read_text()), json.loads(a.diff[1].read_text()))
    with tempfile.TemporaryDirectory(prefix="kconvert-identity-") as tmp:
        sizes = {k: v for k, v in (("layers", a.layers), ("experts", a.experts)) if v}
        result = fingerprint(Path(tmp), a.presets.split(","), not a.no_logits, sizes)
    text = json.dumps(result, indent=1, sort_keys=True)
    if a.out:
        a.out.write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
