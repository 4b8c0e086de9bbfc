"""Draft heads: the acceptance of greedy speculative decoding with a trained fixture's MTP head, converted at each
scheme and tp degree, beside the source head's own (verify's draft check: kconvert/verify/draft.py), and the
tokens each target step yields; then `python -m engine.chat --speculative` at k = 1 .. 3 drafts a step on the
none conversion, against plain greedy chat (the same text; its acceptance, tokens per target step, tokens/s).

    .venv/bin/python bench/draft_bench.py --preset tiny-dsv32-trained --tp 1,2 --workdir /tmp/kdraft
    .venv/bin/python bench/draft_bench.py --preset tiny-dsv4-trained --tp 1,2 --schemes none,fp8,int8,int4,fp4
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
    kconvert/fixtures/trained.py and trained_mtp.py): a head trained otherwise is rebuilt, not measured again."""
    from kconvert.fixtures import trained, trained_mtp

    rec_file = src / "kconvert_training.json"
    if not rec_file.exists():
        return False
    rec = json.loads(rec_file.read_text())
    return (rec.get("steps"), rec.get("mtp_steps"), rec.get("mtp_lr"), rec.get("mtp_batch")) == \
        (trained.STEPS, trained_mtp.STEPS, trained_mtp.LR, trained_mtp.BATCH)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny-dsv32-trained")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--schemes", default="none,fp8,int8,int4")
    ap.add_argument("--workdir", default="/tmp/kdraft")
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


if __name__ == "__main__":
    main()
