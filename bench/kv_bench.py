"""KV cache benchmark: memory per token and decode ms/token vs context for bf16, fp8, int8 and the host
tier; the tier's bytes moved per token; the KLD each KV format adds, and where it comes from; the 8-bit
scale granularity.

    .venv/bin/python bench/kv_bench.py --preset tiny-k25-dsv32-trained --contexts 1k,32k --steps 16 --rounds 5
    .venv/bin/python bench/kv_bench.py --preset tiny-k25-dsv32-trained --kld-only --kld-tokens 256 --breakdown
    .venv/bin/python bench/kv_bench.py --preset tiny-k25-dsv32-trained-wide --kld-only --kld-tokens 1024 --breakdown

Decode cost depends on what the cache holds, not on how it got there, so each context is filled with
synthetic rows (random latent / indexer keys written through the cache's own write path), then every
format runs `--steps` real decode steps per round, formats interleaved round by round (the machine's
load hits all of them alike); ms/token is the median over `--rounds`. "tiered" runs with
--kv-device-budget = 1/8 of the cache's latent bytes; its logits must equal the untiered run's, step by step.
KLD: real prefill of `--kld-tokens` tokens in `--text-windows` held-out stdlib windows (verify's three
prompt windows, then more held-out stdlib text; the text mean has a 95 % bootstrap interval over windows)
and in one window of random ids, mean over positions, of each format against the fp32 cache and against the
bf16 cache ("added": KLD(bf16-cache run || 8-bit-cache run)). Compute is fp32, weights dequantized once.
"simulated": rows round-tripped through a code on their way into a fp32 cache, which also tries a
Hadamard rotation of the indexer keys before fp8 (DeepSeek-V3.2's inference code rotates q and k).
The quality measurements live in bench/kv_quality.py; this file times the cache and prints everything.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from _cli import fixture  # first: this tree's kconvert and engine on sys.path
from kv_quality import bootstrap_ci, breakdown, granularity, key_errors, kld, simulated, windows


def parse_ctx(s: str) -> int:
    s = s.strip().lower()
    return int(float(s[:-1]) * 1024) if s.endswith("k") else int(s)


def load(preset: str, work: Path, indexer_steps: int | None = None):
    """The converted fixture (built once into `work`); `indexer_steps` overrides a trained preset's indexer
    distillation (0: the seeded indexer), in a directory of its own."""
    from engine.model import Model
    from kconvert.convert.shard.job import ShardJob, shard
    from kconvert.convert.layout import Topology

    name = preset if indexer_steps is None else f"{preset}-indexer{indexer_steps}"
    src, conv = work / name, work / f"{name}-conv"
    if not conv.exists():
        if indexer_steps is not None:  # the recipe a build of `src` below follows
            from kconvert.fixtures.training import text as trained
            from kconvert.fixtures.presets import TRAINED_PRESETS, TRAINED_TEXT

            text = TRAINED_TEXT[TRAINED_PRESETS[preset]]
            trained.RECIPE_OVERRIDES[text] = {**trained.RECIPE_OVERRIDES[text], "indexer_steps": indexer_steps}
        shard(ShardJob(str(fixture(preset, src)), str(conv), topology=Topology(tp=1)))
    model = Model.from_converted(conv, dtype=torch.float32)
    model.materialize()
    return model, conv


def fill(model, cache, tokens: int, seed: int = 0, chunk: int = 4096) -> None:
    """Write `tokens` synthetic entries (unit-RMS latent like the normed kv_a output, rotated-key scale)."""
    c, g = model.cfg, torch.Generator().manual_seed(seed)
    for s0 in range(0, tokens, chunk):
        S = min(chunk, tokens - s0)
        step = cache.begin(S)
        for layer in cache.layers:
            layer.write(step, torch.randn(1, S, c.kv_lora_rank, generator=g),
                        torch.randn(1, S, c.qk_rope_head_dim, generator=g))
            if cache.idx_fmt:
                layer.write_index(step, torch.randn(1, S, c.index_head_dim, generator=g))
        cache.commit(step)


def bench_context(model, ctx: int, steps: int, rounds: int) -> list[dict]:
    from engine.cache.latent import KVOptions

    caches = {}
    for kv_dtype in ("bf16", "fp8", "int8", "fp8-ds"):
        for tier in (False, True):
            probe = model.new_cache(1, 8, kv=KVOptions(kv_dtype))
            budget = ctx * probe.latent_bytes_per_token // 8 if tier else None
            cache = model.new_cache(1, ctx + steps * rounds + 2, kv=KVOptions(kv_dtype, device_budget=budget))
            fill(model, cache, ctx)
            caches[kv_dtype, tier] = cache
    tok = torch.tensor([[1]])
    for cache in caches.values():
        model.forward(tok, cache, last_only=True)  # warm-up
    ms = {k: [] for k in caches}
    logits = {k: [] for k in caches}
    moved = dict.fromkeys(caches, 0)
    for _ in range(rounds):
        for k, cache in caches.items():
            m0 = cache.placement.stats.moved_bytes
            t0 = time.perf_counter()
            for _ in range(steps):
                logits[k].append(model.forward(tok, cache, last_only=True))
            ms[k].append((time.perf_counter() - t0) * 1000 / steps)
            moved[k] += cache.placement.stats.moved_bytes - m0
    rows = []
    for (kv_dtype, tier), cache in caches.items():
        med = statistics.median(ms[kv_dtype, tier])
        rows.append({"context": ctx, "kv": kv_dtype + (" tiered" if tier else ""), "bytes_per_token": cache.bytes_per_token,
                     "cache_bytes": cache.nbytes(), "ms_per_token": med, "ms_rounds": ms[kv_dtype, tier],
                     "moved_bytes_per_token": moved[kv_dtype, tier] / (steps * rounds),
                     "tier_ratio": med / statistics.median(ms[kv_dtype, False]) if tier else None,
                     "logits_equal": bool(torch.equal(torch.cat(logits[kv_dtype, tier]),
                                                      torch.cat(logits[kv_dtype, False]))) if tier else None})
    return rows


# More held-out text than verify's three prompt files (none of these is in the trained fixtures' corpus,
# kconvert/fixtures/training/text.py CORPUS_FILES): per-position KLD is heavy-tailed (one fragile position can be
# most of a window's mean), so the text mean is taken over --text-windows windows spread across all of it.
def _row(name: str, vals: dict) -> str:
    text = [vals[w] for w in vals if w.startswith("text")]
    return f"  {name:26s} text {sum(text) / len(text):.2e}  random {vals['random']:.2e}  ({', '.join(f'{v:.1e}' for v in text)})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny-k25-dsv32-trained")
    ap.add_argument("--contexts", default="1k,4k,16k,32k")
    ap.add_argument("--steps", type=int, default=8, help="decode steps per format per round")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds; ms/token is their median")
    ap.add_argument("--kld-tokens", type=int, default=256)
    ap.add_argument("--text-windows", type=int, default=32, help="held-out text windows for the KLD: verify's 3 prompt windows, then more held-out stdlib text")
    ap.add_argument("--indexer-steps", type=int, help="a trained preset with this many indexer distillation steps "
                    "instead of its recipe's (0: the seeded indexer it had before 2026-11-30)")
    ap.add_argument("--kld-only", action="store_true")
    ap.add_argument("--breakdown", action="store_true", help="added KLD of each layer's latent / indexer keys")
    ap.add_argument("--work", default=None, help="fixture/conversion directory (kept between runs)")
    a = ap.parse_args()
    work = Path(a.work or tempfile.gettempdir()) / "kv_bench"
    work.mkdir(parents=True, exist_ok=True)
    model, conv = load(a.preset, work, a.indexer_steps)
    c = model.cfg
    print(f"{a.preset}: {c.num_layers} layers, kv_lora_rank {c.kv_lora_rank}, rope {c.qk_rope_head_dim}, "
          f"index_head_dim {c.index_head_dim}, topk {c.index_topk}; load average {os.getloadavg()[0]:.1f}")
    print("8-bit latent: relative RMS error by scale tile (all layers' latent rows; searched: best of 0.5..1 x amax)")
    for g in granularity(model):
        print(f"  {g['code']:4s} tile {g['group']:4d}: {g['row_bytes']} B/latent  amax {g['amax']:.4f}  searched {g['searched']:.4f}")
    wins = windows(model, conv, a.kld_tokens, a.text_windows)
    k = kld(model, wins)
    print(f"KV KLD, mean over positions ({a.kld_tokens} tokens; text = mean of {a.text_windows} held-out windows):")
    print(" vs the fp32 cache:")
    for f, v in k.items():
        print(_row(f, v["vs_fp32"]))
    print(" added = KLD(bf16-cache run || this run):")
    for f, v in k.items():
        if f != "bf16":
            text = [w for w in v["vs_bf16"] if w != "random"]
            worst = max(v["max_vs_bf16"][w] for w in text)
            rest = (sum(v["vs_bf16"][w] for w in text) * a.kld_tokens - worst) / (len(text) * a.kld_tokens - 1)
            print(_row(f, v["vs_bf16"]) + f"  p99 text {max(v['p99_vs_bf16'][w] for w in text):.1e}"
                  f"  worst position {worst:.1e} (text mean without it {rest:.1e})"
                  + ("  95 %% CI of the text mean %.1e..%.1e" % bootstrap_ci([v["vs_bf16"][w] for w in text])
                     if len(text) > 3 else ""))
    ke = key_errors(model)
    codes = ("bf16", "int8", "fp8", "fp8-hadamard")
    print(" indexer keys, relative RMS error: " + "  ".join(f"{c} {ke[c]:.4f}" for c in codes)
          + f"; median amax/RMS per key {ke['amax/rms']:.2f}, rotated {ke['amax/rms rotated']:.2f}")
    print(" simulated (rows round-tripped into a fp32 cache), added vs the simulated bf16 cache:")
    for f, v in simulated(model, wins).items():
        print(_row(f, v))
    if a.breakdown:
        print(" added by one layer's 8-bit part (the rest bf16):")
        for name, r in breakdown(model, wins):
            print(_row(name, r))
    sys.stdout.flush()
    if a.kld_only:
        return
    print(f"{'context':>8} {'kv':>12} {'B/token':>8} {'cache MiB':>10} {'ms/token':>9} {'tier/flat':>9} "
          f"{'moved B/tok':>12} equal  rounds (ms)")
    for ctx in map(parse_ctx, a.contexts.split(",")):
        for r in bench_context(model, ctx, a.steps, a.rounds):
            ratio = "" if r["tier_ratio"] is None else f"{r['tier_ratio']:.2f}x"
            print(f"{r['context']:>8} {r['kv']:>12} {r['bytes_per_token']:>8} {r['cache_bytes'] / 2 ** 20:>10.2f} "
                  f"{r['ms_per_token']:>9.2f} {ratio:>9} {r['moved_bytes_per_token']:>12.0f} "
                  f"{'' if r['logits_equal'] is None else str(r['logits_equal']):5s}  "
                  + " ".join(f"{x:.0f}" for x in r["ms_rounds"]))
            sys.stdout.flush()
    print(f"load average at the end: {os.getloadavg()[0]:.1f} (1 min), {os.getloadavg()[1]:.1f} (5 min)")


if __name__ == "__main__":
    main()
