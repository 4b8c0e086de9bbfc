"""DeepSeek-V4's cache (engine/models/deepseek_v4/cache.py): decode cost and memory against the context, and the KLD each
--kv-dtype adds. Two parts, either or both:

    .venv/bin/python bench/v4_cache_bench.py --cost --contexts 1k,32k,128k,1M --work /tmp/v4cache-work
    .venv/bin/python bench/v4_cache_bench.py --quality --work /tmp/v4cache-work      # tiny-dsv4-trained

Cost (tiny-dsv4, fp32): per context and --kv-dtype, the cache is filled, then `--steps` single-token decode
steps are timed (median of `--rounds` interleaved rounds). Contexts up to --prefill-max are filled by a real
chunked prefill (and transformers' DeepseekV4ForCausalLM decodes the same context side by side); longer ones
are filled synthetically: a real prefill of 1k tokens, then each layer's compressed entries and indexer keys
extended with random rows in the cache's code up to context // rate (decode cost depends on the counts, not
the values; the selection still runs over every key). Prints ms/token (wall and CPU time: on a shared machine
the CPU time moves less with other jobs), the compressed entries a step reads,
the cache's bytes (in use = plan's formula; allocated) and the process RSS, so growth is visible.

Quality (tiny-dsv4-trained, built once into --work): added KLD(bf16-cache run || this run), mean over
positions, over held-out text windows (bench/kv_quality.windows: verify's 3 + more held-out stdlib text)
and one random-id window, with a 95 % bootstrap interval of the text mean."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from _cli import conversion, fixture  # first: this tree's kconvert and engine on sys.path

DTYPES = ("bf16", "fp8", "int8", "fp8-ds")


def parse_ctx(s: str) -> int:
    """1k = 1024, 1M = 1048576 tokens."""
    s = s.strip().lower()
    scale = {"k": 1024, "m": 1024 ** 2}.get(s[-1:], 1)
    return int(float(s[:-1] if scale > 1 else s) * scale)


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def converted(preset: str, work: Path) -> Path:
    """`preset` and its tp 1 conversion in `work` (each built once: later runs reuse them)."""
    return conversion(fixture(preset, work / preset), work / f"{preset}-tp1")


def fill(model, cache, ctx: int, prefill_max: int, chunk: int) -> str:
    """Bring `cache` to `ctx` tokens: a real prefill, or 1k real + synthetic compressed rows (see module doc)."""
    real = ctx if ctx <= prefill_max else 1024
    ids = torch.randint(0, model.cfg.vocab_size, (1, real), generator=torch.Generator().manual_seed(ctx))
    for s in range(0, real, chunk):
        model.forward(ids[:, s:s + chunk], cache, last_only=True)
    if real == ctx:
        return "prefill"
    g = torch.Generator().manual_seed(1)
    for L, st in enumerate(cache.layers):
        rate = model.layer(L).self_attn.rate
        for comp in (st.compressor, st.indexer):
            if comp.store is None:
                continue
            more = ctx // rate - comp.count
            dim = comp.fmt.dim if hasattr(comp.fmt, "dim") else comp.fmt.width  # EntryFormat / RowFormat
            for s in range(0, more, 65536):  # in slices: the random floats of 1M rows need not exist at once
                n = min(65536, more - s)
                comp.append(torch.randn(1, n, dim, generator=g, dtype=torch.float32))
        st.length = ctx
    cache.lengths = [ctx] * cache.batch
    return "synthetic"


def decode_cost(model, ctx: int, a, ref=None) -> list[dict]:
    """Per --kv-dtype (and transformers with its own cache, where `ref` is given): median ms per decode step
    over `a.rounds` rounds, interleaved so a loaded machine slows every contender alike."""
    from engine.cache.latent import KVOptions

    caches, how = {}, None
    for d in a.dtypes:
        caches[d] = model.new_cache(1, ctx + a.steps * (a.rounds + 1) + 2, kv=KVOptions(d))
        how = fill(model, caches[d], ctx, a.prefill_max, a.chunk)
    tok = torch.tensor([[1]])
    steps = {d: (lambda c=c: model.forward(tok, c, last_only=True)) for d, c in caches.items()}
    if ref is not None and how == "prefill":
        steps["transformers"] = hf_stepper(ref, ctx, a.chunk)
    ms, cpu = {d: [] for d in steps}, {d: [] for d in steps}
    for step in steps.values():
        step()  # warm-up
    for _ in range(a.rounds):
        for d, step in steps.items():
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(a.steps):
                step()
            ms[d].append((time.perf_counter() - t0) * 1000 / a.steps)
            cpu[d].append((time.process_time() - c0) * 1000 / a.steps)  # CPU time: less moved by other jobs
    nan = float("nan")
    hf, hf_cpu = (statistics.median(ms["transformers"]), statistics.median(cpu["transformers"])) \
        if "transformers" in ms else (nan, nan)
    rows = []
    for d, cache in caches.items():
        entries = sum(min(s.compressor.count, model.cfg.section.get("index_topk", 0)) if s.indexer.store is not None
                      else s.compressor.count for s in cache.layers)
        keys = sum(s.indexer.count for s in cache.layers)
        rows.append({"context": ctx, "kv": d, "fill": how, "ms": statistics.median(ms[d]), "rounds": ms[d], "hf": hf,
                     "cpu": statistics.median(cpu[d]), "hf_cpu": hf_cpu,
                     "entries_read": entries, "keys_scored": keys, "in_use": cache.bytes_in_use(),
                     "allocated": cache.nbytes(), "rss": rss_mib()})
    del caches, steps
    return rows


def hf_stepper(ref, ctx: int, chunk: int):
    """transformers prefilled with the same ids (its DynamicCache); returns one decode step."""
    from transformers import DynamicCache

    cache = DynamicCache(config=ref.config.get_text_config())
    ids = torch.randint(0, ref.config.vocab_size, (1, ctx), generator=torch.Generator().manual_seed(ctx))
    tok = torch.tensor([[1]])
    with torch.no_grad():
        for s in range(0, ctx, chunk):
            ref(input_ids=ids[:, s:s + chunk], past_key_values=cache, use_cache=True, logits_to_keep=1)

    @torch.no_grad()
    def step():
        ref(input_ids=tok, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return step


def run_cost(a, work: Path) -> None:
    from engine.model import Model

    conv = converted("tiny-dsv4", work)
    model = Model.from_converted(conv, dtype=torch.float32)
    model.materialize(torch.float32)
    ref = None
    if not a.skip_hf:
        from transformers import DeepseekV4ForCausalLM

        ref = DeepseekV4ForCausalLM.from_pretrained(str(work / "tiny-dsv4"), dtype=torch.float32).eval()
    s = model.cfg.section
    print(f"tiny-dsv4: {model.cfg.num_layers} layers {s.get('layer_types')}, window {s.get('sliding_window')}, "
          f"rates {s.get('compress_rates')}, index_topk {s.get('index_topk')}; fp32, {torch.get_num_threads()} threads, "
          f"{a.steps} steps x {a.rounds} rounds; load average {os.getloadavg()[0]:.1f}")
    print(f"{'context':>8} {'kv':>7} {'fill':>9} {'ms/token':>9} {'hf ms/tok':>9} {'cpu ms/tok':>10} {'hf cpu':>7} {'entries read':>12} "
          f"{'keys scored':>11} {'cache MiB':>10} {'alloc MiB':>10} {'RSS MiB':>8}  rounds (ms)")
    for ctx in [parse_ctx(c) for c in a.contexts.split(",")]:
        for r in decode_cost(model, ctx, a, ref):
            print(f"{r['context']:>8} {r['kv']:>7} {r['fill']:>9} {r['ms']:>9.2f} {r['hf']:>9.2f} {r['cpu']:>10.2f} "
                  f"{r['hf_cpu']:>7.2f} {r['entries_read']:>12} "
                  f"{r['keys_scored']:>11} {r['in_use'] / 2 ** 20:>10.2f} {r['allocated'] / 2 ** 20:>10.2f} "
                  f"{r['rss']:>8.0f}  " + " ".join(f"{x:.1f}" for x in r["rounds"]), flush=True)
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")


def run_quality(a, work: Path) -> None:
    from engine.cache.latent import KVOptions
    from engine.model import Model
    from kv_quality import bootstrap_ci, windows

    conv = converted("tiny-dsv4-trained", work)
    model = Model.from_converted(conv, dtype=torch.float32)
    model.materialize(torch.float32)
    wins = windows(model, conv, a.kld_tokens, a.text_windows)
    added = {d: {} for d in DTYPES if d != "bf16"}
    worst = dict.fromkeys(added, 0.0)
    bf16_vs_fp32 = {}
    for w, ids in wins.items():
        base = model.forward(ids, model.new_cache(1, ids.shape[1], kv=KVOptions("bf16"))).log_softmax(-1)
        full = model.forward(ids, model.new_cache(1, ids.shape[1])).log_softmax(-1)
        bf16_vs_fp32[w] = float((full.exp() * (full - base)).sum(-1).mean())
        for d in added:
            lp = model.forward(ids, model.new_cache(1, ids.shape[1], kv=KVOptions(d))).log_softmax(-1)
            k = (base.exp() * (base - lp)).sum(-1).flatten()
            added[d][w] = float(k.mean())
            if w != "random":
                worst[d] = max(worst[d], float(k.max()))
    print(f"tiny-dsv4-trained, {a.kld_tokens} tokens per window, {a.text_windows} held-out text windows + 1 random; "
          "added KLD vs the bf16 cache, mean over positions:")
    text = [bf16_vs_fp32[w] for w in bf16_vs_fp32 if w != "random"]
    print(f"  (bf16 cache vs the fp32 cache: text {sum(text) / len(text):.2e}, random {bf16_vs_fp32['random']:.2e})")
    for d, v in added.items():
        text = [v[w] for w in v if w != "random"]
        lo, hi = bootstrap_ci(text)
        print(f"  {d:7s} text {sum(text) / len(text):.2e} [95 % {lo:.1e}, {hi:.1e}]  random {v['random']:.2e}  "
              f"worst text position {worst[d]:.1e}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cost", action="store_true")
    ap.add_argument("--quality", action="store_true")
    ap.add_argument("--contexts", default="1k,32k,128k")
    ap.add_argument("--dtypes", default="bf16,fp8", help="--kv-dtype values timed in the cost part")
    ap.add_argument("--prefill-max", type=parse_ctx, default=parse_ctx("32k"),
                    help="longest context filled by a real prefill (longer: synthetic rows)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--kld-tokens", type=int, default=512)
    ap.add_argument("--text-windows", type=int, default=32)
    ap.add_argument("--work", default="/tmp/v4cache-work")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: a shared machine's spinning threads "
                    "cost more than they give)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    a.dtypes = tuple(a.dtypes.split(","))
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    if a.quality:
        run_quality(a, work)
    if a.cost or not a.quality:
        run_cost(a, work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
