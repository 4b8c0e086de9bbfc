"""Decode tokens/s of the engine vs transformers on small-k25-dsv32, same checkpoint, same threads, side by side.

    .venv/bin/python bench/decode_bench.py --contexts 1k,4k,16k --steps 16
    .venv/bin/python bench/decode_bench.py --preset tiny-dsv4 --contexts 1k,4k,16k    # DeepSeek-V4's layers

Both sides compute in fp32 from the same bf16 checkpoint (the engine on a `--quant none --tp 1` conversion,
weights dequantized once at load; transformers from the source directory). Each context is prefilled in
chunks (transformers' dense prefill of 16k tokens at once would need tens of GB for its masks), then
`--steps` single-token decode steps are timed. Prints per-token decode time, tokens/s and the ratio.
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

from _cli import conversion, fixture  # first: this tree's kconvert and engine on sys.path


def parse_ctx(s: str) -> int:
    s = s.strip().lower()
    return int(float(s[:-1]) * 1024) if s.endswith("k") else int(s)


def bench_engine(model, ids, steps, chunk):
    cache = model.new_cache(1, ids.shape[1] + steps + 1)
    t0 = time.perf_counter()
    for s in range(0, ids.shape[1], chunk):
        model.forward(ids[:, s:s + chunk], cache, last_only=True)
    prefill = time.perf_counter() - t0
    tok = torch.tensor([[1]])
    model.forward(tok, cache, last_only=True)  # warm-up step
    t0 = time.perf_counter()
    for _ in range(steps):
        model.forward(tok, cache, last_only=True)
    return prefill, (time.perf_counter() - t0) / steps


@torch.no_grad()
def bench_hf(ref, ids, steps, chunk):
    from transformers import DynamicCache

    cache = DynamicCache(config=ref.config.get_text_config())
    t0 = time.perf_counter()
    for s in range(0, ids.shape[1], chunk):
        ref(input_ids=ids[:, s:s + chunk], past_key_values=cache, use_cache=True, logits_to_keep=1)
    prefill = time.perf_counter() - t0
    tok = torch.tensor([[1]])
    ref(input_ids=tok, past_key_values=cache, use_cache=True, logits_to_keep=1)
    t0 = time.perf_counter()
    for _ in range(steps):
        ref(input_ids=tok, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return prefill, (time.perf_counter() - t0) / steps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="1k,4k,16k")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=1024, help="prefill chunk (tokens)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--work", default=None, help="directory for the fixture and its conversion (default: temp)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--preset", default="small-k25-dsv32", help="fixture preset (small-k25-dsv32, tiny-dsv4, ...)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    from engine.model import Model

    work = Path(a.work or tempfile.mkdtemp(prefix="decode-bench-"))
    src = fixture(a.preset, work / a.preset)
    conv = conversion(src, work / f"{a.preset}-tp1")
    contexts = [parse_ctx(c) for c in a.contexts.split(",")]
    model = Model.from_converted(conv, dtype=torch.float32)
    model.materialize(torch.float32)
    ref = None
    if not a.skip_hf:  # the family's transformers class (its manifest's reference_class)
        import transformers

        ref = getattr(transformers, model.names.family["reference_class"]).from_pretrained(str(src), dtype=torch.float32)
        ref = ref.eval()
    print(f"{a.preset} (index_topk {model.cfg.index_topk}), fp32, {a.threads} threads, {a.steps} decode steps, "
          f"prefill chunk {a.chunk}")
    print(f"{'context':>8} {'engine ms/tok':>14} {'hf ms/tok':>10} {'engine tok/s':>13} {'hf tok/s':>9} {'ratio':>6} "
          f"{'engine prefill tok/s':>21} {'hf prefill tok/s':>17}")
    for n in contexts:
        ids = torch.randint(0, min(768, model.cfg.vocab_size), (1, n), generator=torch.Generator().manual_seed(n))
        ep, ed = bench_engine(model, ids, a.steps, a.chunk)
        hp, hd = bench_hf(ref, ids, a.steps, a.chunk) if ref is not None else (float("nan"), float("nan"))
        print(f"{n:>8} {ed * 1e3:>14.1f} {hd * 1e3:>10.1f} {1 / ed:>13.1f} {1 / hd:>9.1f} {hd / ed:>6.2f} "
              f"{n / ep:>21.0f} {n / hp:>17.0f}", flush=True)
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB (both models in one process)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
