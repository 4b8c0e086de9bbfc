"""Kimi K3 decode: the cost of one token as the context grows, the engine beside the MLX reference (mlx-lm's
kimi_k3 with its own cache) on the same checkpoint, both float32 on the CPU, one thread.

KDA layers decode from a fixed-size state, so their cost per token must not grow with the context; MLA layers
read one latent row per earlier token, so theirs does (that is the design: 69 of K3's 93 layers are KDA).
For each context it prefills that many tokens, then times `--steps` one-token decode steps: the engine's total,
its KDA layers' share (timed around each KDA module's forward), and mlx-lm's total. Then a chat turn with
`--context 1M` on the same conversion, with its peak RSS: nothing is sized by the context up front.

    .venv/bin/python bench/k3_decode_bench.py                         # tiny-kimi-k3, 1k / 4k / 16k
    .venv/bin/python bench/k3_decode_bench.py --contexts 1k,8k --steps 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from _cli import ROOT, conversion, fixture, measured


def parse_ctx(text: str) -> int:
    return int(text[:-1]) * 1024 if text.endswith("k") else int(text)


def engine_decode(conv: Path, context: int, steps: int) -> tuple[float, float]:
    """(ms per token, of which in KDA layers) after a `context`-token prefill."""
    import torch

    from engine.model import Model
    from engine.models.kimi_linear.kda import KDA

    model = Model.from_converted(conv, dtype=torch.float32)
    kda_time = [0.0]

    def timed(module, forward):
        def run(*a, **kw):
            t = time.perf_counter()
            try:
                return forward(*a, **kw)
            finally:
                kda_time[0] += time.perf_counter() - t
        return run

    for m in model.modules():
        if isinstance(m, KDA):
            m.forward = timed(m, m.forward)
    cache = model.new_cache(1, context + steps + 3)
    ids = torch.randint(3, 700, (1, context), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        logits = model.forward(ids, cache, last_only=True)
        token = logits[:, -1:].argmax(-1)
        for _ in range(2):  # warm up, as for mlx-lm
            token = model.forward(token, cache, last_only=True)[:, -1:].argmax(-1)
        kda_time[0], t0 = 0.0, time.perf_counter()
        for _ in range(steps):
            token = model.forward(token, cache, last_only=True)[:, -1:].argmax(-1)
        total = time.perf_counter() - t0
    return 1000 * total / steps, 1000 * kda_time[0] / steps


def mlx_decode(src: Path, context: int, steps: int) -> float:
    import mlx.core as mx
    from mlx_lm.utils import load_model

    model, _ = load_model(src, strict=True)
    model.set_dtype(mx.float32)
    cache = model.make_cache()
    ids = mx.random.randint(3, 700, (1, context), key=mx.random.key(0))
    for s in range(0, context, 2048):  # prefill in chunks, as mlx-lm's generate does
        mx.eval(model(ids[:, s:s + 2048], cache=cache))
    token = mx.array([[5]])
    for _ in range(2):  # warm up: the first decode steps build what later ones reuse
        token = mx.argmax(model(token, cache=cache)[:, -1:], axis=-1)
        mx.eval(token)
    t0 = time.perf_counter()
    for _ in range(steps):
        logits = model(token, cache=cache)
        token = mx.argmax(logits[:, -1:], axis=-1)
        mx.eval(token)
    return 1000 * (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny-kimi-k3")
    ap.add_argument("--contexts", default="1k,4k,16k")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--work", default="/tmp/k3-decode")
    a = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    work = Path(a.work)
    src = fixture(a.preset, work / a.preset)
    conv = conversion(src, work / f"{a.preset}-tp1", tp=1)
    print(f"{a.preset}, float32, 1 thread; ms per decoded token after a prefill of the context (engine: median of 2 runs)")
    print("| context | engine | of which KDA layers | mlx-lm | engine / mlx-lm |\n|---|---|---|---|---|")
    rows = []
    for ctx in map(parse_ctx, a.contexts.split(",")):
        ours = [engine_decode(conv, ctx, a.steps) for _ in range(2)]
        total, kda = statistics.median(o[0] for o in ours), statistics.median(o[1] for o in ours)
        ref = mlx_decode(src, ctx, a.steps)  # one run: mlx-lm's CPU prefill of 16k tokens takes minutes
        rows.append((ctx, total, kda, ref))
        print(f"| {ctx:,} | {total:.1f} | {kda:.1f} | {ref:.1f} | {total / ref:.2f} |", flush=True)
    (c0, t0, k0, r0), (c1, t1, k1, r1) = rows[0], rows[-1]
    print(f"\nfrom {c0:,} to {c1:,} tokens of context: engine x{t1 / t0:.2f} per token (KDA layers x{k1 / k0:.2f}), "
          f"mlx-lm x{r1 / r0:.2f}")
    chat = measured([sys.executable, "-m", "engine.chat", str(conv), "--complete", "--prompt", "def main(",
                     "--max-new-tokens", "8", "--temperature", "0", "--context", str(1 << 20)], cwd=ROOT)
    print(f"chat --context 1M (8 tokens): exit {chat['returncode']}, peak RSS {chat['peak_rss'] / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
