"""Draft heads: the acceptance of greedy speculative decoding with a trained fixture's MTP head, converted at each
scheme and tp degree, beside the source head's own (verify's draft check: kconvert/verify/draft.py), and the
tokens each target step yields; then `python -m engine.chat --speculative` at k = 1 .. 3 drafts a step on the
none conversion, against plain greedy chat (the same text; its acceptance, tokens per target step, tokens/s).

    .venv/bin/python bench/draft_bench.py --preset tiny-dsv32-trained --tp 1,2 --workdir /tmp/kdraft
    .venv/bin/python bench/draft_bench.py --preset tiny-dsv4-trained --tp 1,2 --schemes none,fp8,int8,int4,fp4
    .venv/bin/python bench/draft_bench.py --preset tiny-dsv4-dspark-trained --tp 1 --schemes none,fp8,int8 \
        --damage markov,main_proj,s0-expert0,s0-shared,s0-experts

tiny-dsv4-dspark-trained's DSpark drafter (V4-Flash-0731 layout) drafts a block of 4 a step. `--damage` names
DAMAGES of its stages to make on copies of the tp 1 none conversion (kconvert/verify/damage.zero), each then
verified against the source (`verify --against`): what its draft check says of a drafter a loader damaged.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from _cli import ROOT, cli  # bench/ is the script's folder: on sys.path

SCHEMES = {"none": ["--quant", "none"], "fp8": ["--quant", "fp8"], "int8": ["--quant", "int8"],
           "int4": ["--quant", "int4"], "fp4": ["--quant", "fp4"]}
# tiny-dsv4-dspark-trained's drafter damaged as a loader would leave it: stored names, zeroed
DAMAGES = {"markov": ["mtp.2.markov_head.markov_w1.weight", "mtp.2.markov_head.markov_w2.weight"],
           "main_proj": ["mtp.0.main_proj.weight"],
           "s0-expert0": [f"mtp.0.ffn.experts.0.w{i}.weight" for i in (1, 2, 3)],
           "s1-expert0": [f"mtp.1.ffn.experts.0.w{i}.weight" for i in (1, 2, 3)],
           "s0-shared": [f"mtp.0.ffn.shared_experts.w{i}.weight" for i in (1, 2, 3)],
           "s0-experts": [f"mtp.0.ffn.experts.{e}.w{i}.weight" for e in range(8) for i in (1, 2, 3)]}
PROMPT = "class Stack:\n    def __init__(self, items=None):\n        self.items = "  # not a run of one token


def chat(out: Path, *args) -> tuple[str, str, float]:
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "engine.chat", str(out), "--prompt", PROMPT, "--complete",
                        "--max-new-tokens", "96", "--dtype", "fp32", *map(str, args)], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    text, _, stats = r.stdout.rpartition("\n[TTFT")
    return text, stats, time.perf_counter() - t


def current_training(src: Path) -> bool:
    """Whether a fixture built earlier in the work folder was trained with today's recipe (its training record vs
    kconvert/fixtures/training/text.py and training/mtp.py): a head trained otherwise is rebuilt, not measured again."""
    from kconvert.fixtures.training import text as trained
    from kconvert.fixtures.training import dspark as trained_dspark
    from kconvert.fixtures.training import mtp as trained_mtp

    rec_file = src / "kconvert_training.json"
    if not rec_file.exists():
        return False
    rec = json.loads(rec_file.read_text())
    if "dspark_steps" in rec:  # a DSpark drafter's training (kconvert/fixtures/training/dspark.py)
        return (rec["steps"], rec["dspark_steps"], rec["dspark_lr"], rec["dspark_batch"], rec["dspark_seq_len"]) == \
            (trained.STEPS, trained_dspark.STEPS, trained_dspark.LR, trained_dspark.BATCH, trained_dspark.SEQ_LEN)
    return (rec.get("steps"), rec.get("mtp_steps"), rec.get("mtp_lr"), rec.get("mtp_batch")) == \
        (trained.STEPS, trained_mtp.STEPS, trained_mtp.LR, trained_mtp.BATCH)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny-dsv32-trained")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--schemes", default="none,fp8,int8,int4")
    ap.add_argument("--workdir", default="/tmp/kdraft")
    ap.add_argument("--damage", default="", help=f"damages of the tp 1 none conversion: {', '.join(DAMAGES)}")
    args = ap.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    src = work / f"{args.preset}-s{args.seed}"
    if not (src / "config.json").exists() or not current_training(src):
        shutil.rmtree(src, ignore_errors=True)
        (work / f"{src.name}-ref.safetensors").unlink(missing_ok=True)  # made from the old source
        r = cli("fixture", args.preset, src, "--seed", args.seed)
        assert r.returncode == 0, r.stderr
    ref = work / f"{src.name}-ref.safetensors"
    if not ref.exists():
        assert cli("reference", src, "--out", ref).returncode == 0
    rows = []
    for tp in map(int, args.tp.split(",")):
        for label in args.schemes.split(","):
            out = work / f"{src.name}-tp{tp}-{label}"
            shutil.rmtree(out, ignore_errors=True)
            r = cli("shard", src, out, "--tp", tp, *SCHEMES[label])
            assert r.returncode == 0, r.stderr
            r = cli("verify", out, "--reference", ref, "--json")
            rep = json.loads(r.stdout)
            d = rep["draft"]
            rows.append((tp, label, rep["verdict"], d))
            print(json.dumps({"tp": tp, "scheme": label, "verdict": rep["verdict"], "draft": d}), flush=True)
    print(f"\n{args.preset}: verify's draft check ({rows[0][3]['limits']['new_tokens']} tokens after each prompt)\n")
    print("| tp | scheme | head | mean KLD | same top-1 | acceptance | source head | tokens / target step | draft check "
          "| verify |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for tp, label, verdict, d in rows:
        h = d["heads"][0]
        print(f"| {tp} | {label} | {h['head']} | {h['mean_kld']:.2g} | {h['same_top1_pct']:.1f} % | "
              f"{100 * h['acceptance']:.1f} % | {100 * h['reference_acceptance']:.1f} % | {h['tokens_per_step']:.2f} | "
              f"{d['verdict']} | {verdict} |")
    none = work / f"{src.name}-tp1-none"
    if args.damage:
        damage_table(none, ref, src, args.damage.split(","))
    if none.exists():
        plain, stats, secs = chat(none)
        print(f"\nchat on {none.name}, {PROMPT!r} + 96 tokens, fp32\n\n| drafts a step | same text | acceptance "
              f"| tokens / target step | tokens/s (plain: {re.search(r'([0-9.]+) tokens/s', stats)[1]}) |\n|---|---|---|---|---|")
        for k in (1, 2, 3):
            text, stats, secs = chat(none, "--speculative", "--draft-tokens", k)
            acc = re.search(r"acceptance ([0-9.]+) %", stats)[1]
            per = re.search(r"([0-9.]+) tokens/target step", stats)[1]
            tps = re.search(r"([0-9.]+) tokens/s", stats)[1]
            print(f"| {k} | {text == plain} | {acc} % | {per} | {tps} |")


def damage_table(none: Path, ref: Path, src: Path, names: list[str]) -> None:
    """Each damage of DAMAGES on a copy of the tp 1 none conversion, verified against the source."""
    from kconvert.verify.damage import zero

    print("\n| damage | mean KLD | acceptance (source) | per depth | draft check fails on | verify |\n|---|---|---|---|---|---|")
    for name in names:
        out = none.with_name(f"{none.name}-{name}")
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(none, out)
        zero(out, *DAMAGES[name])
        rep = json.loads(cli("verify", out, "--reference", ref, "--against", src, "--json").stdout)
        h, fails = rep["draft"]["heads"][0], rep["draft"]["failures"]
        on = " and ".join(w for w, key in (("predictions", "mean KLD"), ("acceptance", "acceptance")) if any(key in f for f in fails))
        print(f"| {name} | {h['mean_kld']:.2g} | {100 * h['acceptance']:.1f} % ({100 * h['reference_acceptance']:.1f} %) | "
              f"{' / '.join(f'{100 * x:.0f}' for x in h['per_depth'])} | {on or 'nothing (PASS)'} | {rep['verdict']} |",
              flush=True)


if __name__ == "__main__":
    main()
