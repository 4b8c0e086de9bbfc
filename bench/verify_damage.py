"""Damaged fp8 conversions of the trained tiny-k25-dsv32 must FAIL verify's faithfulness check; clean
conversions of every scheme must not, for any seed of the trained fixture.

Damage (consistent checksums, wrong numbers): kconvert/verify/damage.py's CASES, the ones tests/verify/test_verify.py
runs on three prompts (here on the full held-out set, at tp 2): one expert's up_proj scales x30 (expert 0
of layer 2: the trained fixture's layer 2 routes every token to 4 experts), one layer's o_proj scales x8,
rank 0's and rank 1's experts of layer 1 swapped, one output row of one q_b_proj slice with its sign flipped.

    .venv/bin/python bench/verify_damage.py --workdir /tmp/kdamage                 # damage table, seed 0
    .venv/bin/python bench/verify_damage.py --seeds 20 --no-damage                 # false FAILs over 20 seeds
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from _cli import cli  # first: this tree's kconvert on sys.path (bench/ is the script's folder)
from kconvert.verify.damage import CASES

CLEAN = {"none": [], "fp8": ["--quant", "fp8"], "fp8-ue8m0": ["--quant", "fp8", "--scale-format", "ue8m0"],
         "int8": ["--quant", "int8"], "int4": ["--quant", "int4"]}


def damage(clean: Path, work: Path) -> dict[str, Path]:
    """A fresh copy of `clean` per case, damaged."""
    cases = {}
    for name, case in CASES.items():
        d = cases[name] = work / name.replace(" ", "-").replace("'", "")
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(clean, d)
        case.apply(d)
    return cases


def row(name: str, rep: dict) -> str:
    f, c = rep["faithfulness"]["overall"], rep["cost"]["overall"]
    return (f"| {name} | {rep['faithfulness']['verdict']} | {f['mean_kld']:.2e} | {f['p99_kld']:.2e} | "
            f"{f['same_top1_pct']:.2f} % | {rep['cost']['verdict']} | {c['mean_kld']:.2e} | {c['p99_kld']:.3f} | "
            f"{c['same_top1_pct']:.2f} % | {c['ppl_ratio']:.4f} | {rep.get('fault_at')} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="/tmp/kdamage")
    ap.add_argument("--seeds", type=int, default=1, help="trained fixtures to check clean conversions on")
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--tp", default="2", help="comma-separated tp degrees for the clean conversions")
    ap.add_argument("--no-damage", action="store_true", help="only the clean conversions")
    args = ap.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    head = ("| case | faithfulness | faithful mean KLD | faithful p99 | faithful top-1 | cost | cost mean KLD "
            "| cost p99 KLD | cost top-1 | PPL ratio | first fault |\n|---|---|---|---|---|---|---|---|---|---|---|")
    false_fails = total = 0
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        src, ref = work / f"tiny-k25-dsv32-trained-s{seed}", work / f"ref-s{seed}.safetensors"
        if not (src / "config.json").exists():
            shutil.rmtree(src, ignore_errors=True)
            print(cli("fixture", "tiny-k25-dsv32-trained", src, "--seed", seed, check=True).stdout.strip(), flush=True)
        if not ref.exists():
            cli("reference", src, "--out", ref, "--hidden-states", check=True)
        print(f"\nseed {seed}\n{head}", flush=True)
        for tp in map(int, args.tp.split(",")):
            for label, extra in CLEAN.items():
                out = work / f"s{seed}-tp{tp}-{label}"
                shutil.rmtree(out, ignore_errors=True)
                cli("shard", src, out, "--tp", tp, *extra, check=True)
                rep = json.loads(cli("verify", out, "--reference", ref, "--json").stdout)
                total += 1
                false_fails += rep["faithfulness"]["verdict"] != "PASS"
                print(row(f"clean {label} tp{tp}", rep), flush=True)
        if args.no_damage or seed:
            continue
        clean = work / f"s{seed}-tp2-fp8"
        fq = work / f"fq-s{seed}.safetensors"
        cli("reference", src, "--out", fq, "--like", clean, "--hidden-states", check=True)
        for name, d in damage(clean, work).items():
            r = cli("verify", d, "--reference", ref, "--faithful-reference", fq, "--per-layer", "--json")
            print(row(name, json.loads(r.stdout)), flush=True)
    print(f"\nclean conversions: {false_fails} faithfulness FAILs out of {total}")


if __name__ == "__main__":
    main()
