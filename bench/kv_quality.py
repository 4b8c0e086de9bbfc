"""The quality half of bench/kv_bench.py: the KLD each KV-cache format adds (real prefill over held-out
text windows and random ids, against the fp32 and the bf16 cache), where it comes from (per layer,
latent vs indexer keys), simulated codes (with a Hadamard rotation of the indexer keys) and the 8-bit
scale granularity. kv_bench.py runs these and prints them. Its importers import bench/_cli.py first, which puts
this tree's kconvert and engine first on sys.path (the functions here import them when called)."""

from __future__ import annotations

from pathlib import Path

import torch

# label -> (--kv-dtype, indexer key code override): the shipped formats first, then the mixes that split
# the error between the latent and the indexer keys
KLD_FORMATS = {"bf16": ("bf16", None), "fp8 (keys bf16)": ("fp8", None), "int8 (keys bf16)": ("int8", None),
               "fp8-ds (keys fp8)": ("fp8-ds", None), "bf16 latent + fp8 keys": ("bf16", "fp8"),
               "int8 latent + int8 keys": ("int8", "int8"), "bf16 latent + int8 keys": ("bf16", "int8")}



MORE_HELD_OUT = ("argparse.py", "dataclasses.py", "enum.py", "functools.py", "tarfile.py", "configparser.py")


def windows(model, conv: Path, tokens: int, count: int = 3) -> dict[str, torch.Tensor]:
    """`count` held-out stdlib text windows (never trained on): the three of verify's prompt files (offsets
    0, 3000, 6000, as always), then `count - 3` non-overlapping ones spread evenly over MORE_HELD_OUT; and
    one window of random ids."""
    from kconvert.fixtures.training.text import CORPUS_FILES
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
    from engine.cache.latent import KVOptions

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
    from engine.cache.row_format import dequantize, quantize_fp8, quantize_int8

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
    from engine.cache.row_format import dequantize, quantize_fp8, quantize_int8

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
