"""Verify statistics of clean none/int8/fp8 and three damaged fp8 conversions of tiny-k3 (the numbers behind
manifests/verify_thresholds.toml): one expert's up_proj scales x30, one layer's o_proj scales x8,
rank 0's and rank 1's experts of layer 1 swapped. Uses the same rewrite as tests/test_verify.py.

    .venv/bin/python bench/verify_damage.py --workdir /tmp/kdamage
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from helpers import run_cli  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from test_verify import P, _rewrite  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="/tmp/kdamage")
    work = Path(ap.parse_args().workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    src, clean, ref = work / "tiny-k3", work / "fp8-tp2", work / "ref.safetensors"
    run_cli("fixture", "tiny-k3", src, check=True)
    run_cli("shard", src, clean, "--tp", 2, "--quant", "fp8", check=True)
    run_cli("reference", src, "--out", ref, check=True)

    def fresh(name: str) -> Path:
        d = work / name
        shutil.copytree(clean, d)
        return d

    cases = {}
    for quant in ("none", "int8"):
        cases[f"clean {quant}"] = work / quant
        run_cli("shard", src, work / quant, "--tp", 2, "--quant", quant, check=True)
    cases["clean fp8"] = clean
    d = cases["expert up_proj x30"] = fresh("expert")
    n = f"{P}2.mlp.experts.3.up_proj.weight_scale_inv"
    _rewrite(d, "rank-000/layer-0002.safetensors", lambda t: t.__setitem__(n, t[n] * 30))
    d = cases["o_proj scales x8"] = fresh("scales")
    n = f"{P}1.self_attn.o_proj.weight_scale_inv"
    for r in (0, 1):
        _rewrite(d, f"rank-00{r}/layer-0001.safetensors", lambda t: t.__setitem__(n, t[n] * 8))
    d = cases["experts swapped"] = fresh("swap")
    r0, r1 = (load_file(d / f"rank-00{r}/layer-0001.safetensors") for r in (0, 1))

    def renumber(tensors: dict, shift: int) -> dict:
        out = {}
        for k, v in tensors.items():
            if ".mlp.experts." in k:
                head, rest = k.split(".mlp.experts.")
                e, tail = rest.split(".", 1)
                out[f"{head}.mlp.experts.{int(e) + shift}.{tail}"] = v
        return out

    into0, into1 = renumber(r1, -8), renumber(r0, 8)
    _rewrite(d, "rank-000/layer-0001.safetensors", lambda t: t.update(into0))
    _rewrite(d, "rank-001/layer-0001.safetensors", lambda t: t.update(into1))
    print(f"{'case':>20} {'verdict':>7} {'mean KLD':>9} {'p99 KLD':>8} {'top-1':>7}")
    for name, d in cases.items():
        o = json.loads(run_cli("verify", d, "--reference", ref, "--json").stdout)
        s = o["overall"]
        print(f"{name:>20} {o['verdict']:>7} {s['mean_kld']:9.4f} {s['p99_kld']:8.3f} {s['same_top1_pct']:6.1f}%")


if __name__ == "__main__":
    main()
