"""Damaged fp8 conversions of the trained DeepSeek-V4 fixture must FAIL verify's faithfulness check with the
damaged layer named (the V4 damage figures in docs/BENCHMARKS.md). Run after bench/verify_bench.py made the clean tp 2 fp8
conversion and the reference in --workdir:

    .venv/bin/python bench/verify_bench.py --preset tiny-dsv4-trained --tp 2 --schemes fp8 --workdir /tmp/kverify-v4
    .venv/bin/python bench/v4_verify_damage.py --workdir /tmp/kverify-v4
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

from _cli import cli  # first: this tree's kconvert on sys.path (bench/ is the script's folder)
from kconvert.verify import damage


def flip_row(t, n):  # e4m3 has no negation kernel: flip the sign bits of one output row
    t[n][5] = (t[n][5].view(torch.uint8) ^ 0x80).view(torch.float8_e4m3fn)


CASES = {
    "row sign flip (layers.1.attn.wq_b)": ("layers.1.attn.wq_b.weight", flip_row),
    "expert scale x30 (layers.2 expert 3 w1)": ("layers.2.ffn.experts.3.w1.weight_scale_inv", lambda t, n: t[n].mul_(30)),
    "o-proj scales x8 (layers.3.attn.wo_b)": ("layers.3.attn.wo_b.weight_scale_inv", lambda t, n: t[n].mul_(8)),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="/tmp/kverify-v4")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    work = Path(a.workdir)
    clean, ref = work / f"tiny-dsv4-trained-s{a.seed}-tp2-fp8", work / f"ref-s{a.seed}.safetensors"
    print("| damage | faithful mean KLD | faithfulness | cost mean KLD | cost | first fault |\n|---|---|---|---|---|---|")
    for label, (name, mutate) in CASES.items():
        out = work / "damaged"
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(clean, out)
        damage.rewrite(out, damage.files_holding(out, name)[0], lambda t: mutate(t, name))
        r = cli("verify", out, "--reference", ref, "--per-layer", "--json")
        rep = json.loads(r.stdout)
        f, c = rep["faithfulness"], rep["cost"]
        print(f"| {label} | {f['overall']['mean_kld']:.3g} | {f['verdict']} | {c['overall']['mean_kld']:.3g} | "
              f"{c['verdict']} | {rep['fault_at']} |", flush=True)
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
