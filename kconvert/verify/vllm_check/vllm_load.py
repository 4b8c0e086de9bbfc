"""The `load` job of driver.py (runs in the vLLM environment: vLLM, torch and safetensors only): vLLM's model class
built (vllm_claims.py lends what construction lacks on this CPU) and loaded by vLLM's own loader, every stored
tensor's parameter region recorded, every weight dequantized from the parameters as loaded (vllm_dequant.py).
"""

from __future__ import annotations

import os
import socket

import torch

from vllm_dequant import dequantize, stored_shapes, weights_of  # noqa: E402 (driver.py puts this folder first)


_DIST = []


def build(cfg):
    """vLLM's model for `cfg` (an engine config) on the CPU, not loaded, in one process of one rank."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.utils.torch_utils import set_default_torch_dtype

    context = set_current_vllm_config(cfg)  # entered for the build and the load (layers read it); kept referenced:
    context.__enter__()  # a collected context would restore the previous config
    _DIST.append(context)
    if len(_DIST) == 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        initialize_model_parallel(1, 1)
        _DIST.append(port)
    loader = get_model_loader(cfg.load_config)
    with set_default_torch_dtype(cfg.model_config.dtype), torch.device("cpu"):
        model = loader.create_model(vllm_config=cfg, model_config=cfg.model_config)
    return model, loader


def _storage(t: torch.Tensor):
    try:
        return t.untyped_storage().data_ptr()
    except Exception:
        return None


def load_recorded(model, loader, cfg) -> dict:
    """Load `model` with vLLM's loader; {"loaded": {stored name: [[param, [[start, stop] per dim], transposed]]},
    "skipped": [stored names no parameter took], "unfilled": {param: [cells never written, cells]}}."""
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    current, by_storage, records, seen = [None], {}, {}, []
    params = dict(model.named_parameters())
    filled = {n: torch.zeros(p.shape, dtype=torch.bool) for n, p in params.items()}

    def wrap(pname, p):
        real = getattr(p, "weight_loader", default_weight_loader)

        def recorded(param, loaded, *a, **k):
            r = real(param, loaded, *a, **k)
            if r is False:  # a MoE loader's "not this expert here"
                return r
            keep, probe = param.data, torch.zeros_like(param.data)
            param.data = probe
            try:
                real(param, torch.ones_like(loaded), *a, **k)
            finally:
                param.data = keep
            mask = probe != 0
            filled[pname] |= mask
            name = by_storage.get(_storage(loaded), current[0])
            records.setdefault(name, []).append(_region(pname, mask, tuple(loaded.shape)))
            return r

        p.weight_loader = recorded

    for n, p in params.items():
        wrap(n, p)
    every = loader.get_all_weights

    def all_weights(model_config, m):
        for name, t in every(model_config, m):
            current[0] = name
            by_storage[_storage(t)] = name
            seen.append(name)
            yield name, t

    loader.get_all_weights = all_weights
    before = {n: p.detach().clone() for n, p in params.items()}
    loader.load_weights(model, cfg.model_config)
    skipped = [n for n in seen if n not in records]
    _direct_copies(params, before, filled, records, skipped, cfg.model_config.model)
    unfilled = {n: [int((~m).sum()), m.numel()] for n, m in filled.items() if not bool(m.all())}
    return {"loaded": records, "skipped": [n for n in seen if n not in records], "unfilled": unfilled,
            "stored": len(seen)}


def _direct_copies(params, before, filled, records, skipped, root) -> None:
    """Stored tensors a model's load_weights copies into a parameter itself, past any weight loader (vLLM's V4 does so
    for `attn_sink`): a parameter whose cells changed where no loader wrote, named like a skipped stored tensor (its
    name ends with the stored name) and holding its values there, is recorded as that tensor's region."""
    from safetensors import safe_open

    files = {}
    for f in sorted(os.listdir(root)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(root, f), "pt") as h:
                files.update({k: os.path.join(root, f) for k in h.keys()})
    for pname, p in params.items():
        old, new = before[pname], p.detach()
        changed = (new != old) & ~(new.isnan() & old.isnan()) if new.is_floating_point() else new != old
        changed &= ~filled[pname]
        if not bool(changed.any()):
            continue
        name = next((s for s in skipped if pname == s or pname.endswith("." + s)), None)
        if name is None:
            continue
        with safe_open(files[name], "pt") as h:
            stored = h.get_tensor(name)
        region = _region(pname, changed, tuple(stored.shape))
        cut = _as_loaded(params, region, tuple(stored.shape))
        if cut is not None and torch.equal(cut, stored.to(cut.dtype)):
            filled[pname] |= changed
            records[name] = [region]


def _region(pname: str, mask: torch.Tensor, shape: tuple) -> list:
    """[param, its cells' bounding box, whether the box holds the stored tensor transposed]; box None when the cells
    written are not one box of the stored tensor's size."""
    idx = mask.nonzero()
    if idx.numel() == 0:
        return [pname, None, False]
    lo, hi = idx.min(0).values.tolist(), (idx.max(0).values + 1).tolist()
    box = [[a, b] for a, b in zip(lo, hi)]
    sizes = [b - a for a, b in box]
    n = 1
    for s in shape:
        n *= s
    if int(mask.sum()) != n or _numel(sizes) != n:
        return [pname, None, False]
    kept = [s for s in sizes if s != 1] if len(sizes) > len(shape) else sizes
    flipped = len(shape) == 2 and list(shape[::-1]) == kept and list(shape) != kept
    return [pname, box, flipped]


def _numel(sizes) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def _as_loaded(model_params: dict, rec: list, shape) -> torch.Tensor | None:
    pname, box, flipped = rec
    if box is None:
        return None
    t = model_params[pname].data[tuple(slice(a, b) for a, b in box)]
    t = t.t() if flipped and t.dim() == 2 else t
    return t.reshape(shape) if t.numel() == _numel(shape) else None


def write_dequantized(report: dict, model, cfg, out: str) -> None:
    """OUT/loaded.safetensors: every stored weight (its `.weight` name) dequantized as loaded, every other stored tensor
    as loaded; report["not_compared"]: stored names whose parameter region could not be cut out."""
    from safetensors.torch import save_file

    params = dict(model.named_parameters())
    shapes = stored_shapes(cfg.model_config.model)
    block = getattr(cfg.quant_config, "weight_block_size", None) if cfg.quant_config is not None else None
    loaded = report["loaded"]

    def value(name):
        recs = loaded.get(name)
        return _as_loaded(params, recs[0], shapes[name]) if recs else None

    result, uncut = {}, []
    for out_name, (wname, sname) in weights_of(shapes).items():
        if wname not in loaded:
            continue  # skipped by vLLM: reported as such
        w, s = value(wname), value(sname) if sname else None
        if w is None or (sname and s is None):
            uncut.append(wname if w is None else sname)
            continue
        full = _packed_shape(params, loaded, wname[: -len(".weight_packed")], shapes) \
            if wname.endswith(".weight_packed") else None
        result[out_name] = dequantize(w, s, block, full).contiguous()
    report["not_compared"] = uncut
    report["loaded"] = {n: [[r[0], r[2]] for r in recs] for n, recs in loaded.items()}
    os.makedirs(out, exist_ok=True)
    save_file(result, os.path.join(out, "loaded.safetensors"))


def _packed_shape(params, loaded, base, shapes):
    """A packed weight's [out, in], as its `weight_shape` loaded (vLLM keeps it in a float parameter)."""
    name = base + ".weight_shape"
    t = _as_loaded(params, loaded[name][0], shapes[name]) if name in loaded else None
    return [int(v) for v in t.to(torch.float64).tolist()] if t is not None else None
