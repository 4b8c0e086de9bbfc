"""KV cache benchmark: memory per token and decode ms/token vs context for bf16, fp8, int8 and the host
tier; the tier's bytes moved per token; the KLD each KV format adds, and where it comes from; the 8-bit
scale granularity.

    .venv/bin/python bench/kv_bench.py --preset tiny-k3-trained --contexts 1k,32k --steps 16 --rounds 5
    .venv/bin/python bench/kv_bench.py --preset tiny-k3-trained --kld-only --kld-tokens 256 --breakdown
    .venv/bin/python bench/kv_bench.py --preset tiny-k3-trained-wide --kld-only --kld-tokens 1024 --breakdown

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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# label -> (--kv-dtype, indexer key code override): the shipped formats first, then the mixes that split
# the error between the latent and the indexer keys
KLD_FORMATS = {"bf16": ("bf16", None), "fp8 (keys bf16)": ("fp8", None), "int8 (keys bf16)": ("int8", None),
               "fp8-ds (keys fp8)": ("fp8-ds", None), "bf16 latent + fp8 keys": ("bf16", "fp8"),
               "int8 latent + int8 keys": ("int8", "int8"), "bf16 latent + int8 keys": ("bf16", "int8")}


def parse_ctx(s: str) -> int:
    s = s.strip().lower()
    return int(float(s[:-1]) * 1024) if s.endswith("k") else int(s)


def load(preset: str, work: Path, indexer_steps: int | None = None):
    """The converted fixture (built once into `work`); `indexer_steps` overrides a trained preset's indexer
    distillation (0: the seeded indexer), in a directory of its own."""
    from engine.model import Model
    from kconvert.convert.shard import ShardJob, shard
    from kconvert.fixtures import build_fixture

    name = preset if indexer_steps is None else f"{preset}-indexer{indexer_steps}"
    src, conv = work / name, work / f"{name}-conv"
    if not conv.exists():
        if not src.exists():
            if indexer_steps is not None:
                from kconvert.fixtures import trained
                from kconvert.fixtures.presets import TRAINED_PRESETS, TRAINED_TEXT

                text = TRAINED_TEXT[TRAINED_PRESETS[preset]]
                trained.RECIPE_OVERRIDES[text] = {**trained.RECIPE_OVERRIDES[text], "indexer_steps": indexer_steps}
            build_fixture(preset, src)
        shard(ShardJob(str(src), str(conv), tp=1))
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
    from engine.cache import KVOptions

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
# kconvert/fixtures/trained.py CORPUS_FILES): per-position KLD is heavy-tailed (one fragile position can be
# most of a window's mean), so the text mean is taken over --text-windows windows spread across all of it.
MORE_HELD_OUT = ("argparse.py", "dataclasses.py", "enum.py", "functools.py", "tarfile.py", "configparser.py")


def windows(model, conv: Path, tokens: int, count: int = 3) -> dict[str, torch.Tensor]:
    """`count` held-out stdlib text windows (never trained on): the three of verify's prompt files (offsets
    0, 3000, 6000, as always), then `count - 3` non-overlapping ones spread evenly over MORE_HELD_OUT; and
    one window of random ids."""
    from kconvert.fixtures.trained import CORPUS_FILES
    from kconvert.source.tokenizer import load_kimi_tokenizer
    from kconvert.verify.prompts import HELD_OUT_FILES, stdlib_text

    assert not set(MORE_HELD_OUT) & set(CORPUS_FILES)
    enc = load_kimi_tokenizer(conv)
    ids = enc.encode(stdlib_text(HELD_OUT_FILES), disallowed_special=())
    out = {f"text{i}": torch.tensor([ids[o:o + tokens]]) for i, o in enumerate((0, 3000, 6000)[:count])}
    if count > 3:
        more = enc.encode(stdlib_text(MORE_HELD_OUT), disallowed_special=())
        if len(more) < tokens * (count - 3):
            raise SystemExit(f"{count - 3} more windows of {tokens} tokens need {tokens * (count - 3)} held-out "
                             f"tokens; there are {len(more)}")
        stride = (len(more) - tokens) // max(1, count - 4)
        out |= {f"text{3 + i}": torch.tensor([more[i * stride:i * stride + tokens]]) for i in range(count - 3)}
    out["random"] = torch.randint(0, model.cfg.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(5))
    return out


def bootstrap_ci(values: list[float], rounds: int = 10000, seed: int = 0) -> tuple[float, float]:
    """95 % interval of the mean of `values` (windows resampled with replacement): how far the text mean could
    move with other windows of the same text, since per-position KLD is heavy-tailed."""
    v = torch.tensor(values, dtype=torch.float64)
    idx = torch.randint(0, len(v), (rounds, len(v)), generator=torch.Generator().manual_seed(seed))
    means = v[idx].mean(1)
    return float(means.quantile(0.025)), float(means.quantile(0.975))


def _kld(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return (p.exp() * (p - q)).sum(-1).flatten()


def kld(model, wins: dict[str, torch.Tensor]) -> dict[str, dict]:
    """Per format: mean KLD vs the fp32 cache and vs the bf16 cache, per window."""
    from engine.cache import KVOptions

    out = {f: {"vs_fp32": {}, "vs_bf16": {}, "p99_vs_bf16": {}, "max_vs_bf16": {}} for f in KLD_FORMATS}
    for w, ids in wins.items():
        n = ids.shape[1]
        base = model.forward(ids, model.new_cache(1, n)).log_softmax(-1)
        runs = {f: model.forward(ids, model.new_cache(1, n, kv=KVOptions(d, index_dtype=i))).log_softmax(-1)
                for f, (d, i) in KLD_FORMATS.items()}
        for f, lp in runs.items():
            added = _kld(runs["bf16"], lp)
            out[f]["vs_fp32"][w] = float(_kld(base, lp).mean())
            out[f]["vs_bf16"][w] = float(added.mean())
            out[f]["p99_vs_bf16"][w] = float(added.quantile(0.99))
            out[f]["max_vs_bf16"][w] = float(added.max())
    return out


def breakdown(model, wins: dict[str, torch.Tensor]) -> list[tuple[str, dict]]:
    """Added KLD (vs the bf16 cache) of 8-bit latent or 8-bit indexer keys in one layer at a time, everything
    else bf16: rows are quantized and dequantized on the way into a fp32 cache (the same code as the 8-bit rows)."""
    out = []
    for code in ("fp8", "int8", "fp8-hadamard"):
        for layer in range(model.cfg.num_layers):
            for part, lat, key in (("latent", code, "bf16"), ("indexer keys", "bf16", code)):
                if code == "fp8-hadamard" and part == "latent":
                    continue
                r = {w: float(_kld(fake_run(model, ids, "bf16", "bf16"), fake_run(model, ids, lat, key, layer)).mean())
                     for w, ids in wins.items()}
                out.append((f"{code} {part}, layer {layer}", r))
    return out


def hadamard(n: int) -> torch.Tensor:
    """The orthonormal Sylvester Hadamard matrix of order n (a power of 2); symmetric, so H @ H = I."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h / n ** 0.5


def fake(code: str):
    """Round trip of a row through an 8-bit code (the engine's own quantize / dequantize). "fp8-hadamard":
    rotate by H, fp8, rotate back, as DeepSeek-V3.2's inference code does with its indexer q and k (H is
    orthogonal, so scoring H q against the stored H k equals scoring q against this round trip)."""
    from engine.kv_format import dequantize, quantize_fp8, quantize_int8

    if code == "bf16":
        return lambda x: x.to(torch.bfloat16).to(x.dtype)
    if code == "fp8-hadamard":
        def rot(x):
            h = hadamard(x.shape[-1]).to(x.dtype)
            return (dequantize(*quantize_fp8(x @ h, 128), 128).to(x.dtype)) @ h
        return rot
    q = quantize_fp8 if code == "fp8" else quantize_int8
    return lambda x: dequantize(*q(x, 128), 128).to(x.dtype)


def fake_run(model, ids, lat: str, key: str, layer: int | None = None) -> torch.Tensor:
    """Log-probs with rows quantized and dequantized on the way into a fp32 cache (`layer`: only there,
    bf16 elsewhere)."""
    cache = model.new_cache(1, ids.shape[1])
    for i, L in enumerate(cache.layers):
        lq, kq = (fake(lat), fake(key)) if layer in (None, i) else (fake("bf16"), fake("bf16"))
        w, wi = L.write, L.write_index
        L.write = lambda step, x, r, w=w, lq=lq: w(step, lq(x), fake("bf16")(r))
        L.write_index = lambda step, k, wi=wi, kq=kq: wi(step, kq(k))
    return model.forward(ids, cache).log_softmax(-1)


# label -> (latent code, indexer key code) of the simulated runs (fake_run): the fp8 row checks that the
# simulation reproduces the engine's fp8-ds cache; the others rotate the keys before fp8
SIMULATED = {"fp8-ds (simulated)": ("fp8", "fp8"), "fp8-ds, Hadamard keys": ("fp8", "fp8-hadamard"),
             "bf16 latent + Hadamard fp8 keys": ("bf16", "fp8-hadamard")}


def simulated(model, wins: dict[str, torch.Tensor]) -> dict[str, dict]:
    """Added KLD (vs the simulated bf16 cache) of each SIMULATED format, per window."""
    out = {f: {} for f in SIMULATED}
    for w, ids in wins.items():
        base = fake_run(model, ids, "bf16", "bf16")
        for f, (lat, key) in SIMULATED.items():
            out[f][w] = float(_kld(base, fake_run(model, ids, lat, key)).mean())
    return out


def key_errors(model, tokens: int = 256) -> dict[str, float]:
    """Relative RMS error of the real indexer keys (all layers) under each key code, and amax / RMS per row
    (how much an outlier channel widens fp8's scale)."""
    ids = torch.randint(0, model.cfg.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(9))
    cache, keys = model.new_cache(1, tokens), []
    for L in cache.layers:
        wi = L.write_index
        L.write_index = lambda step, k, wi=wi: (keys.append(k.detach().float()), wi(step, k))[1]
    model.forward(ids, cache)
    k = torch.cat([x.reshape(-1, x.shape[-1]) for x in keys])
    out = {c: float((fake(c)(k) - k).norm() / k.norm()) for c in ("bf16", "int8", "fp8", "fp8-hadamard")}
    ratio = lambda x: float((x.abs().amax(-1) / x.pow(2).mean(-1).sqrt()).median())
    out["amax/rms"], out["amax/rms rotated"] = ratio(k), ratio(k @ hadamard(k.shape[-1]))
    return out


def granularity(model, tokens: int = 256) -> list[dict]:
    """8-bit latent relative RMS error (real latent rows of every layer) per scale tile and scale rule:
    amax, or the per-tile scale among 0.5..1 x amax that minimises the tile's squared error."""
    from engine.kv_format import dequantize, quantize_fp8, quantize_int8

    ids = torch.randint(0, model.cfg.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(9))
    cache = model.new_cache(1, tokens)
    model.forward(ids, cache)
    rows = torch.cat([L.read(torch.arange(tokens)[None], torch.float32)[0][0] for L in cache.layers])
    r = rows.shape[-1]
    out = []
    for code, quant in (("fp8", quantize_fp8), ("int8", quantize_int8)):
        for group in sorted({32, 64, 128, r}):
            err = {}
            for rule, shrinks in (("amax", (1.0,)), ("searched", (1.0, 0.9, 0.8, 0.7, 0.6, 0.5))):
                best = None
                for f in shrinks:  # quantize x / f with amax scales = x with the scale f * amax
                    q, s = quant(rows / f, group)
                    back = dequantize(q, s * f, group)
                    e = (back - rows).unflatten(-1, (-1, group)).pow(2).sum(-1)
                    best = e if best is None else torch.minimum(best, e)
                err[rule] = float(best.sum().sqrt() / rows.norm())
            out.append({"code": code, "group": group, "row_bytes": r + 4 * -(-r // group),
                        "amax": err["amax"], "searched": err["searched"]})
    return out


def _row(name: str, vals: dict) -> str:
    text = [vals[w] for w in vals if w.startswith("text")]
    return f"  {name:26s} text {sum(text) / len(text):.2e}  random {vals['random']:.2e}  ({', '.join(f'{v:.1e}' for v in text)})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny-k3-trained")
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
