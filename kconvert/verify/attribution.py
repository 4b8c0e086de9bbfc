"""Which tensors make one layer wrong: run the layer on the engine's own input with the converted
weights, with faithful weights (the source quantized and dequantized with the conversion's scheme by
verify/fake_quant.py, so quantization noise is not blamed), and with faithful weights for one tensor
at a time. A tensor's share is how much of the layer's output error disappears when only it is faithful.
"""

from __future__ import annotations

import torch

from kconvert.source.checkpoint import Checkpoint
from kconvert.disk_format.units import layer_unit
from kconvert.family.engine_names import engine_keys
from kconvert.load.loader import open_converted
from kconvert.verify.fake_quant import expected_tensor
from kconvert.verify.forward import engine_inputs, stage_states


def _exact(meta_tensors: list[dict], ck: Checkpoint, name: str, quantization: dict) -> torch.Tensor | None:
    """This rank's slice of source tensor `name` as a faithful conversion holds it (None: another rank's)."""
    for t in meta_tensors:
        if t["name"] in (name, name + "_packed"):
            x = ck.read(name, dtype=torch.float32)
            if t["slice"]:
                dim, a, b = t["slice"]
                x = x.narrow(dim, a, b - a).contiguous()
            return expected_tensor(x, {"transform": t["transform"], "slices": [None]}, quantization)
    return None


def attribute(model, out_dir: str, rank: int, prompts, tokens, per_layer: dict) -> list[dict] | None:
    """The ranking, on the ranks of the pipeline stage holding the layer (None on the others, which only
    pass the prompts' hidden states along). Every rank of the run calls this."""
    L = per_layer["attribute_layer"]
    inputs = []
    for p, tk in zip(prompts, tokens):
        ids, img = engine_inputs(p, tk, model, model.mc.raw)
        caches: list = []
        states = stage_states(model, ids, img, caches)
        if L in model.slot:  # ids: for token-routed layers (V4 hash); the cache: what the other layers left in it
            inputs.append((states[L].unsqueeze(0), ids.to(model.device), caches[0]))
    if L not in model.slot:
        return None
    conv = open_converted(out_dir, rank=rank, world_size=model.par.world)
    ck = Checkpoint.open(per_layer["source"])
    unit = layer_unit(L)
    converted = conv.load_unit(unit)
    mine = [t for t in conv.catalog.rank_tensors(rank) if t["unit"] == unit]
    everyone = sorted({t["name"].removesuffix("_packed") for t in conv.catalog.tensors if t["unit"] == unit
                       and not t["name"].endswith(("_scale_inv", "_scale")) and len(t["shape"]) >= 2})

    def with_exact(names: set[str]) -> dict:
        t = dict(converted)
        for n in names:
            x = _exact(mine, ck, n, conv.meta["quantization"])
            if x is None:
                continue  # another rank holds it
            t[n] = x
            for suffix in ("_scale_inv", "_scale", "_packed"):
                t.pop(n + suffix, None)
        return t

    def run(layer) -> list[torch.Tensor]:
        outs = []
        for x, ids, ran in inputs:
            cache = model.new_cache(1, x.shape[1])
            if hasattr(model.stack, "alone"):  # layers that read other layers' state (V4.1) get it from the run
                cache = model.stack.alone(cache, ran, L)
            cos, sin = model.rotary(torch.arange(x.shape[1]), model.dtype)
            outs.append(layer.forward(x.clone(), 0, cache.layers[model.slot[L]], cos[None], sin[None], model.par,
                                      ids=ids)[0])
        return outs

    def layer(tensors: dict):  # formats read off the tensors: the faithful ones replace quantized weights
        return model.build_layer(L, engine_keys(model.names, tensors), use_catalog=False)

    exact = run(layer(with_exact(set(everyone))))
    ref_norm = sum(float(e.pow(2).sum()) for e in exact) ** 0.5

    def err(outs) -> float:
        return sum(float((o - e).pow(2).sum()) for o, e in zip(outs, exact)) ** 0.5 / max(ref_norm, 1e-30)

    base = err(run(layer(dict(converted))))
    ranking = []
    for n in everyone:
        e = err(run(layer(with_exact({n}))))
        ranking.append({"tensor": n, "layer_error_without_it": e, "share": (base - e) / base if base > 0 else 0.0})
    ranking.sort(key=lambda r: -r["share"])
    return [{"layer": L, "layer_error": base}] + ranking
