"""KV cache benchmark: memory per token and decode ms/token vs context for bf16, fp8 and the host tier;
the tier's bytes moved per token; FP8 KV's added KLD; the fp8 scale granularity.

    .venv/bin/python bench/kv_bench.py --preset tiny-k3 --contexts 1k,4k,16k,32k --steps 8
    .venv/bin/python bench/kv_bench.py --preset small-k3 --kld-only

Decode cost depends on what the cache holds, not on how it got there, so each context is filled with
synthetic rows (random latent / indexer keys written through the cache's own write path), then `--steps`
real decode steps are timed. "tiered" runs with --kv-device-budget = 1/8 of the cache's latent bytes and
checks its logits equal the untiered run's. KLD: real prefill of `--kld-tokens` tokens, fp8 (and bf16)
KV vs the compute-dtype (fp32) cache, mean over positions. Compute is fp32 with weights dequantized once.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_ctx(s: str) -> int:
    s = s.strip().lower()
    return int(float(s[:-1]) * 1024) if s.endswith("k") else int(s)


def load(preset: str, work: Path):
    from engine.model import Model
    from kconvert.convert.shard import ShardJob, shard
    from kconvert.fixtures import build_fixture

    src, conv = work / preset, work / f"{preset}-conv"
    if not conv.exists():
        if not src.exists():
            build_fixture(preset, src)
        shard(ShardJob(str(src), str(conv), tp=1))
    model = Model.from_converted(conv, dtype=torch.float32)
    model.materialize()
    return model


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


def decode(model, cache, steps: int):
    tok = torch.tensor([[1]])
    model.forward(tok, cache, last_only=True)  # warm-up
    stats = cache.placement.stats
    moved0 = stats.moved_bytes
    out, t0 = [], time.perf_counter()
    for _ in range(steps):
        out.append(model.forward(tok, cache, last_only=True))
    ms = (time.perf_counter() - t0) * 1000 / steps
    return ms, (stats.moved_bytes - moved0) / steps, torch.cat(out)


def bench_context(model, ctx: int, steps: int) -> list[dict]:
    from engine.cache import KVOptions

    rows, ref = [], {}
    for name, kv_dtype, tier in (("bf16", "bf16", False), ("fp8", "fp8", False),
                                 ("bf16 tiered", "bf16", True), ("fp8 tiered", "fp8", True)):
        probe = model.new_cache(1, ctx + steps + 2, kv=KVOptions(kv_dtype))
        device_budget = ctx * probe.latent_bytes_per_token // 8 if tier else None
        cache = model.new_cache(1, ctx + steps + 2, kv=KVOptions(kv_dtype, device_budget=device_budget))
        fill(model, cache, ctx)
        ms, moved, logits = decode(model, cache, steps)
        if not tier:
            ref[kv_dtype] = logits
        rows.append({"context": ctx, "kv": name, "bytes_per_token": cache.bytes_per_token,
                     "cache_bytes": cache.nbytes(), "ms_per_token": ms, "moved_bytes_per_token": moved,
                     "logits_equal": bool(torch.equal(logits, ref[kv_dtype])) if tier else None})
    return rows


def kld(model, tokens: int, seed: int = 5) -> dict:
    from engine.cache import KVOptions

    ids = torch.randint(0, model.cfg.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(seed))
    base = model.forward(ids, model.new_cache(1, tokens)).log_softmax(-1)
    out = {}
    for d in ("bf16", "fp8"):
        lp = model.forward(ids, model.new_cache(1, tokens, kv=KVOptions(d))).log_softmax(-1)
        k = (base.exp() * (base - lp)).sum(-1)
        out[d] = {"mean_kld": float(k.mean()), "p99_kld": float(k.flatten().quantile(0.99))}
    return out


def granularity(model, tokens: int = 256) -> list[dict]:
    """fp8 latent relative error and bytes per layer-token at several scale tiles (real latent rows)."""
    from engine.kv_format import RowFormat

    ids = torch.randint(0, model.cfg.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(9))
    cache = model.new_cache(1, tokens)
    model.forward(ids, cache)
    rows = cache.layers[0].read(torch.arange(tokens)[None], torch.float32)[0][0]
    out = []
    for group in (32, 64, 128, rows.shape[-1]):
        fmt = RowFormat(rows.shape[-1], model.cfg.qk_rope_head_dim, "fp8", torch.float32, group)
        back = fmt.decode(fmt.encode(rows, torch.zeros(tokens, model.cfg.qk_rope_head_dim)), torch.float32)[0]
        out.append({"group": group, "row_bytes": fmt.row_bytes,
                    "rel_rms_error": float((back - rows).norm() / rows.norm())})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny-k3")
    ap.add_argument("--contexts", default="1k,4k,16k,32k")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--kld-tokens", type=int, default=512)
    ap.add_argument("--kld-only", action="store_true")
    ap.add_argument("--work", default=None, help="fixture/conversion directory (kept between runs)")
    a = ap.parse_args()
    work = Path(a.work or tempfile.gettempdir()) / "kv_bench"
    work.mkdir(parents=True, exist_ok=True)
    model = load(a.preset, work)
    print(f"{a.preset}: {model.cfg.num_layers} layers, kv_lora_rank {model.cfg.kv_lora_rank}, "
          f"rope {model.cfg.qk_rope_head_dim}, index_head_dim {model.cfg.index_head_dim}, topk {model.cfg.index_topk}")
    print("fp8 scale granularity (layer 0 latent):")
    for g in granularity(model):
        print(f"  group {g['group']:4d}: {g['row_bytes']} B/row, relative RMS error {g['rel_rms_error']:.4f}")
    k = kld(model, a.kld_tokens)
    print(f"KV KLD vs fp32 cache ({a.kld_tokens} tokens): " +
          ", ".join(f"{d} mean {v['mean_kld']:.2e} p99 {v['p99_kld']:.2e}" for d, v in k.items()))
    if a.kld_only:
        return
    print(f"{'context':>8} {'kv':>12} {'B/token':>8} {'cache MiB':>10} {'ms/token':>9} {'moved B/tok':>12} equal")
    for ctx in map(parse_ctx, a.contexts.split(",")):
        for r in bench_context(model, ctx, a.steps):
            print(f"{r['context']:>8} {r['kv']:>12} {r['bytes_per_token']:>8} {r['cache_bytes'] / 2 ** 20:>10.2f} "
                  f"{r['ms_per_token']:>9.2f} {r['moved_bytes_per_token']:>12.0f} "
                  f"{'' if r['logits_equal'] is None else r['logits_equal']}")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
