"""The faithfulness reference's weights: the source with every tensor a conversion quantized replaced by
its quantize -> dequantize (QDQ) under the same scheme, slice by slice as the conversion stores it.

Independent of kconvert's own quantizers (kconvert/quant/): the scales are computed here
from the formulas in docs/FORMAT.md ("Quantization formulas") and the rounding, clamping and
dequantization are compressed-tensors' `fake_quantize` (block / channel / group strategies). What a
conversion claims (scheme, which tensors, which transform, which slice) is read from its kconvert.json;
the slices must tile each tensor exactly, or the layout itself is wrong.

A calibrated conversion (kconvert.json `quantization.calibration`: GPTQ codes, which depend on calibration
data no reference has) is held to its own stored codes and scales instead, decoded here by the formulas in
docs/FORMAT.md (int4: nibble - 8, times the group's scale; nvfp4: the nibble's e2m1 value times its block's e4m3
scale times weight_scale_2, fake_quant_nvfp4.py), slice by slice: the check still catches every slicing,
placement, loading and engine fault; what the codes cost is the cost check's question.

`write_fake_quant_source` writes that model as an fp32 checkpoint (plus the source's config without
its quantization_config, and its tokenizer files) for `kconvert reference` to run.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from kconvert.errors import VerifyFailed
from kconvert.io.side_files import MAX_CONFIG, MAX_TEXT, read_bytes, read_json
from kconvert.verify.compressed_tensors_fq import fq
from kconvert.verify.fake_quant_nvfp4 import fused_amax, nvfp4_qdq, stored_nvfp4_fq
from kconvert.verify.stored_codes import COMPANIONS, stored_pieces

QUANTIZED = ("fp8", "int8", "int4", "fp4", "nvfp4")
FP8_E4M3_MAX = 448.0
SCALE_FLOOR = 1e-12  # all-zero blocks/rows/groups: any positive scale dequantizes them to 0
INT4_CLIP_STEPS = 16  # clipping search: scale = (1 - k/50) * amax / 7, k = 0..15, least squared error
INT4_CLIP_STEP = 0.02


def qdq(x: torch.Tensor, scheme: str, *, scale_format: str = "fp32", group_size: int = 32,
        int4_scales: str = "mse", fp8_block: int = 128, tensor_amax: float | None = None) -> torch.Tensor:
    """x [R, C] float32 -> the float32 weight a faithful `scheme` conversion dequantizes to. `tensor_amax`: nvfp4's
    per-tensor amax (its fused group's, the whole tensor's for a slice)."""
    x = x.to(torch.float32)
    R, C = x.shape
    if scheme == "fp8":
        b = fp8_block
        br, bc = -(-R // b), -(-C // b)
        padded = torch.zeros(br * b, bc * b)
        padded[:R, :C] = x.abs()
        scale = (padded.view(br, b, bc, b).amax(dim=(1, 3)) / FP8_E4M3_MAX).clamp_min(SCALE_FLOOR)
        if scale_format == "ue8m0":
            scale = torch.exp2(torch.ceil(torch.log2(scale)))
        return fq(x, scale, num_bits=8, type="float", strategy="block", block_structure=[b, b])
    if scheme == "int8":
        scale = (x.abs().amax(dim=1, keepdim=True) / 127.0).clamp_min(SCALE_FLOOR)
        return fq(x, scale, num_bits=8, type="int", symmetric=True, strategy="channel")
    if scheme == "int4":
        args = dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size)
        amax = x.view(R, C // group_size, group_size).abs().amax(-1)
        steps = INT4_CLIP_STEPS if int4_scales == "mse" else 1
        best, best_err = None, None
        for k in range(steps):
            scale = (amax * (1 - INT4_CLIP_STEP * k) / 7.0).clamp_min(SCALE_FLOOR)
            y = fq(x, scale, **args)
            err = (y - x).pow(2).view(R, C // group_size, group_size).sum(-1)
            if best is None:
                best, best_err = y, err
            else:
                better = (err < best_err)[..., None].expand(R, C // group_size, group_size).reshape(R, C)
                best = torch.where(better, y, best)
                best_err = torch.minimum(err, best_err)
        return best
    if scheme == "fp4":  # MXFP4: a power-of-two scale per 32 inputs putting the group's amax at or under 6
        amax = x.view(R, C // 32, 32).abs().amax(-1)
        exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
        scale = torch.exp2(torch.where(amax > 0, exp, torch.full_like(exp, -127.0)))
        return fq(x, scale, num_bits=4, type="float", strategy="group", group_size=32)
    if scheme == "nvfp4":
        return nvfp4_qdq(x, tensor_amax)
    raise VerifyFailed(f"faithfulness: no reference quantizer for scheme {scheme!r}")


def planned_slices(meta: dict) -> dict[str, dict]:
    """Source tensor name -> {"transform", "slices": [[dim, start, stop] | None, ...]} from kconvert.json,
    checking that the slices of every tensor tile it exactly (one whole copy, or equal, in order)."""
    plan: dict[str, dict] = {}
    for t in meta["tensors"]:
        name = t["name"]
        if t["transform"] in QUANTIZED:
            if name.endswith(COMPANIONS):
                continue
            name = name.removesuffix("_packed")
        entry = plan.setdefault(name, {"transform": t["transform"], "slices": []})
        if entry["transform"] != t["transform"]:
            raise VerifyFailed(f"faithfulness: kconvert.json gives {name} two transforms "
                               f"({entry['transform']}, {t['transform']})", tensor=name)
        s = tuple(t["slice"]) if t["slice"] else None
        if s not in entry["slices"]:
            entry["slices"].append(s)
    for name, entry in plan.items():
        slices = entry["slices"]
        if None in slices:
            if len(slices) > 1:
                raise VerifyFailed("faithfulness: a tensor is both replicated and sliced in kconvert.json", tensor=name)
            continue
        slices.sort(key=lambda s: s[1])
        widths = {b - a for _, a, b in slices}
        contiguous = all(slices[i][2] == slices[i + 1][1] for i in range(len(slices) - 1))
        if len({d for d, _, _ in slices}) != 1 or slices[0][1] != 0 or len(widths) != 1 or not contiguous:
            raise VerifyFailed(f"faithfulness: the tensor-parallel slices of this tensor do not tile it: {slices}",
                               tensor=name)
    return plan


def plan_digest(meta: dict, of_export: bool = False) -> str:
    """What a faithfulness reference depends on: scheme settings and every tensor's transform and slices;
    `of_export` (meta is the temporary conversion of an export): also the export itself, whose stored
    scales the reference uses (its fingerprint is the conversion's source fingerprint)."""
    q = meta["quantization"]
    key = {"scheme": q["scheme"], "scale_format": q.get("scale_format"), "group_size": q.get("group_size"),
           "int4_scales": q.get("int4_scales"), **({"calibration": q["calibration"]} if q.get("calibration") else {}),
           "plan": sorted((n, e["transform"], [list(s) if s else None for s in e["slices"]])
                          for n, e in planned_slices(meta).items())}
    if of_export:
        key["export"] = meta["source"]["fingerprint"]
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def expected_tensor(x: torch.Tensor, entry: dict, q: dict, tensor_amax: float | None = None) -> torch.Tensor:
    """The float32 tensor a faithful conversion holds for source tensor x (all its slices together); `tensor_amax`:
    nvfp4's per-tensor amax (its fused group's), which every slice shares."""
    transform = entry["transform"]
    if transform == "bf16":
        return x.to(torch.bfloat16).to(torch.float32)
    if transform not in QUANTIZED:
        return x  # copy, fp8_copy: the source's own values
    opts = dict(scale_format=q.get("scale_format") or "fp32", group_size=q.get("group_size") or 32,
                int4_scales=q.get("int4_scales") or "mse", fp8_block=(q.get("block_size") or [128])[0])
    if transform == "nvfp4":
        opts["tensor_amax"] = float(x.abs().max()) if tensor_amax is None else tensor_amax
    out = torch.empty_like(x)
    for s in entry["slices"]:
        if s is None:
            return qdq(x, transform, **opts)
        dim, a, b = s
        out.narrow(dim, a, b - a).copy_(qdq(x.narrow(dim, a, b - a), transform, **opts))
    return out


def write_fake_quant_source(src: str, meta: dict, out_dir: Path, converted: str | Path | None = None) -> Path:
    """An fp32 checkpoint in out_dir holding what conversion `meta` should hold, for `kconvert reference`
    (a calibrated conversion: its own codes and scales, read from `converted`, its directory)."""
    plan = planned_slices(meta)
    stored = stored_pieces(converted, meta) if meta["quantization"].get("calibration") else {}
    amax = fused_amax(src, [n for n, e in plan.items() if e["transform"] == "nvfp4"])

    def values(name: str, x: torch.Tensor) -> torch.Tensor:
        if name in stored:
            out = torch.empty_like(x)
            for s, w in stored[name]:
                (out if s is None else out.narrow(s[0], s[1], s[2] - s[1])).copy_(w)
            return out
        return expected_tensor(x, plan[name], meta["quantization"], amax.get(name)) if name in plan else x

    return _write_source(src, out_dir, values)


def stored_rule(qc: dict) -> dict:
    """compressed-tensors QuantizationArgs (as keywords) of the weights a checkpoint's quantization_config
    declares: its own rule, as a serving engine reads it (DeepSeek block-FP8 or one compressed-tensors group)."""
    if qc.get("quant_method") == "fp8":
        return dict(num_bits=8, type="float", strategy="block",
                    block_structure=list(qc.get("weight_block_size") or [128, 128]))
    if qc.get("quant_method") in ("modelopt", "modelopt_mixed") or qc.get("format") == "nvfp4-pack-quantized":
        # NVFP4 tensors are held to their own stored scales (export_values); the rest is Model-Optimizer's block FP8
        return dict(num_bits=8, type="float", strategy="block", block_structure=[128, 128])
    groups = [g for g in (qc.get("config_groups") or {}).values() if g.get("weights")]
    if len(groups) != 1:
        raise VerifyFailed(f"faithfulness: the export declares {len(groups)} weight config groups; one is read")
    return dict(groups[0]["weights"])


def export_values(stored, x: torch.Tensor, rule: dict, block: tuple[int, int] | None = None) -> torch.Tensor:
    """What an export faithful to source values x holds for one logical tensor `stored`
    (source.formats.LogicalTensor; `block` its scale grid in the export): x fake-quantized by the export's rule with
    the scales the export stores, x rounded to the dtype of a tensor it keeps unquantized, or x itself where the
    export keeps the source's own encoding, which its rule cannot write (DeepSeek's fp8-block layout copies the FP4
    experts and V4.1's Engram FP8 rows byte for byte)."""
    from kconvert.io.dtypes import DTYPES
    from kconvert.io.safetensors_read import read_tensor

    if stored.format == "plain":
        dtype = DTYPES[stored.main.dtype]
        return x.to(dtype).to(torch.float32) if dtype.is_floating_point else x
    if stored.format == "nvfp4_packed":  # its own block and tensor scales
        return stored_nvfp4_fq(x, stored)
    if stored.format == "fp4_packed" or (block is not None and "block_structure" in rule
                                         and list(block) != list(rule["block_structure"])):
        return x
    scale = read_tensor(stored.parts["scale"]).to(torch.float32)
    return fq(x, scale[:, 0, :, 0] if scale.dim() == 4 else scale, **rule)  # (ModelOpt's block grid: 4-D)


def write_export_fake_quant_source(src: str, export_dir: str, meta: dict, out_dir: Path) -> Path:
    """An fp32 checkpoint in out_dir holding what the temporary conversion `meta` of export `export_dir`
    should hold if the export is faithful to SRC: each tensor `export_values` of SRC's, then the
    conversion's own transform (a dequantized int4 expert rounds to bf16, int8 re-quantizes per slice)."""
    from kconvert.errors import UsageError
    from kconvert.source.checkpoint import Checkpoint

    exp = Checkpoint.open(export_dir)
    names = set(Checkpoint.open(src, headers_only=True).logical)
    odd = sorted(names ^ set(exp.logical))
    if odd:
        raise UsageError(f"the export and the source hold different tensors ({len(odd)}, first {odd[0]}): "
                         "pass the source the export was made from", file=str(export_dir), tensor=odd[0])
    rule = stored_rule(exp.quantization_config) if exp.quantization_config else {}
    plan, q = planned_slices(meta), meta["quantization"]

    def values(name, x):
        t = exp.logical[name]
        y = export_values(t, x, rule, exp.block_of(name) if t.format == "block_fp8" else None)
        return expected_tensor(y, plan[name], q) if name in plan else y

    return _write_source(src, out_dir, values)


def write_dequantized_source(src: str, out_dir: Path) -> Path:
    """SRC with every weight dequantized to fp32 (exactly: FP8 / FP4 times power-of-two or fp32 scales), for
    families whose released storage transformers cannot run here (manifest `reference_from_dequantized`)."""
    return _write_source(src, out_dir, lambda name, x: x)


def _write_source(src: str, out_dir: Path, values) -> Path:
    """An unquantized checkpoint of SRC's tensors under their names, each float weight `values(name, x)` of its
    fp32 read (integer tables such as V4's tid2eid as stored), its config without quantization_config."""
    from safetensors.torch import save_file

    from kconvert.source.checkpoint import Checkpoint

    ck = Checkpoint.open(src)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in ck.logical.items():
        if t.stored_dtype in ("I64", "I32", "I16", "I8", "U8", "BOOL") and t.format == "plain":
            tensors[name] = ck.read(name).contiguous()
            continue
        tensors[name] = values(name, ck.read(name, dtype=torch.float32)).contiguous()
    save_file(tensors, str(out_dir / "model.safetensors"))
    config = read_json(ck.root / "config.json", limit=MAX_CONFIG)
    config.pop("quantization_config", None)
    if isinstance(config.get("text_config"), dict):
        config["text_config"].pop("quantization_config", None)
    (out_dir / "config.json").write_text(json.dumps(config))
    for f in ck.root.iterdir():  # (not ModelOpt's hf_quant_config.json: the values are unquantized here)
        if f.is_file() and f.name not in ("config.json", "hf_quant_config.json") and \
                not f.name.endswith((".safetensors", ".index.json")):
            (out_dir / f.name).write_bytes(read_bytes(f, limit=MAX_TEXT))  # regular and bounded, as shard copies
    return out_dir
