"""Independent decoders on kconvert's NVFP4 bytes: every NVFP4 weight of `export --format nvfp4` (Model-Optimizer's
layout) and `--format nvfp4-ct` (compressed-tensors') of a fixture, decoded by
- compressed-tensors' NVFP4PackedCompressor (this project's venv; the suite runs the same check: tests/quant),
- nvidia-modelopt's NVFP4QTensor.dequantize, in a SEPARATE virtual environment under /tmp (never in our pins: it is
  made here with `pip install --no-deps nvidia-modelopt` and the few modules it imports, torch taken from this
  project's venv by a .pth file), and its NVFP4QTensor.quantize against kconvert's quantizer on random weights,
- MLX's mx.dequantize(mode="nvfp4") (the codes times the e4m3 block scales; the per-tensor scale applied after),
and compared with kconvert's own dequantization bit for bit (MLX's product order differs: compared exactly where
weight_scale_2 is a power of two, i.e. the exact MXFP4 casts).

    .venv/bin/python bench/nvfp4_decoder_check.py --workdir /tmp/nvfp4-decoders
    .venv/bin/python bench/nvfp4_decoder_check.py --presets tiny-kimi-k3,tiny-dsv4-flash,tiny-kimi-k3-bf16 \
        --venv /tmp/modelopt-venv
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import torch

from _cli import cli  # bench/ is the script's folder: on sys.path

MODELOPT = "nvidia-modelopt==0.47.0"
MODELOPT_IMPORTS = ("omegaconf", "pulp", "nvidia-ml-py")  # what importing its qtensor needs beyond torch

# run inside the modelopt venv: decode every NVFP4 weight of a ModelOpt-layout export, and quantize the random
# weights of `quantize.safetensors` with NVFP4QTensor (ModelOpt's own rule), writing both to OUT
_MODELOPT_SCRIPT = r"""
import sys, torch
from safetensors.torch import load_file, save_file
from modelopt.torch.quantization.qtensor import NVFP4QTensor
src, quant, out = sys.argv[1:4]
res = {}
for f in sorted(__import__("pathlib").Path(src).glob("*.safetensors")):
    t = load_file(str(f))
    for k in t:
        if k.endswith(".weight_scale_2"):
            base = k[: -len("_scale_2")]
            packed = t[base]
            shape = (packed.shape[0], packed.shape[1] * 2)
            q = NVFP4QTensor(torch.Size(shape), torch.float32, packed)
            res["deq:" + base] = q.dequantize(dtype=torch.float32, scale=t[base + "_scale"], double_scale=t[k],
                                              block_sizes={-1: 16})
w = load_file(quant)
for k, x in w.items():
    qt, s, s2 = NVFP4QTensor.quantize(x, 16)
    res["q:" + k] = qt._quantized_data
    res["s:" + k] = s
    res["s2:" + k] = s2.reshape(())
save_file({k: v.contiguous() for k, v in res.items()}, out)
"""


def modelopt_venv(path: Path) -> Path | None:
    """The python of a venv with nvidia-modelopt (made when missing); None, saying why, when it does not install."""
    py = path / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
        site = Path(sysconfig.get_paths()["purelib"])
        (next((path / "lib").glob("python*")) / "site-packages" / "zz_kconvert_venv.pth").write_text(f"{site}\n")
        for args in (["--no-deps", MODELOPT], ["--no-deps", *MODELOPT_IMPORTS]):
            r = subprocess.run([str(py), "-m", "pip", "install", "-q", *args], capture_output=True, text=True)
            if r.returncode:
                print(f"nvidia-modelopt did not install here: {r.stderr.strip().splitlines()[-1]}")
                return None
    r = subprocess.run([str(py), "-c", "from modelopt.torch.quantization.qtensor import NVFP4QTensor"],
                       capture_output=True, text=True)
    if r.returncode:
        print(f"nvidia-modelopt does not import in {path}: {r.stderr.strip().splitlines()[-1]}")
        return None
    return py


def ours(export: Path) -> dict[str, torch.Tensor]:
    """kconvert's dequantization of every NVFP4 weight of an export (float32)."""
    from kconvert.source.checkpoint import Checkpoint

    ck = Checkpoint.open(export)
    return {n: ck.read(n) for n, t in ck.logical.items() if t.format == "nvfp4_packed"}


def ct_decode(export: Path, names) -> dict[str, torch.Tensor]:
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import NVFP4
    from safetensors.torch import load_file

    t = {}
    for f in sorted(export.glob("*.safetensors")):
        t.update(load_file(f))
    scheme = QuantizationScheme(targets=["Linear"], **NVFP4)
    return {n: NVFP4PackedCompressor.decompress({"weight_packed": t[n + "_packed"], "weight_scale": t[n + "_scale"],
                                                 "weight_global_scale": t[n + "_global_scale"]}, scheme)["weight"]
            for n in names}


def mlx_decode(export: Path, names) -> dict[str, torch.Tensor]:
    """MLX's nvfp4 dequantization of the codes and block scales, times weight_scale_2 afterwards."""
    import mlx.core as mx
    import numpy as np
    from safetensors.torch import load_file

    t = {}
    for f in sorted(export.glob("*.safetensors")):
        t.update(load_file(f))
    out = {}
    for n in names:
        words = mx.array(t[n].numpy().view(np.uint32))
        v = mx.dequantize(words, mx.array(t[n + "_scale"].view(torch.uint8).numpy()), group_size=16, bits=4,
                          mode="nvfp4", dtype=mx.float32)
        out[n] = torch.from_numpy(np.array(v)) * t[n + "_scale_2"]
    return out


def compare(label: str, got: dict, want: dict, cast=None) -> dict:
    want = {n: want[n].to(got[n].dtype) if cast is None else cast(want[n]) for n in want}
    same = sum(torch.equal(got[n], want[n]) for n in want)
    worst = max(float((got[n].float() - want[n].float()).abs().max()) for n in want)
    row = {"decoder": label, "tensors": len(want), "bit_exact": same, "max_abs_diff": worst}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # tiny-kimi-k3-bf16: experts from BF16 by ModelOpt's amax rule (weight_scale_2 not a power of two)
    ap.add_argument("--presets", default="tiny-kimi-k3,tiny-dsv4-flash,tiny-kimi-k3-bf16")
    ap.add_argument("--workdir", default="/tmp/nvfp4-decoders")
    ap.add_argument("--venv", default="/tmp/kconvert-modelopt-venv", help="where nvidia-modelopt's venv is (made)")
    args = ap.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    py = modelopt_venv(Path(args.venv))
    from safetensors.torch import save_file

    from kconvert.quant import nvfp4

    g = torch.Generator().manual_seed(0)
    rand = {f"w{i}": (torch.randn(64, 256, generator=g) * 10.0 ** (i - 3)).to(torch.bfloat16) for i in range(5)}
    save_file(rand, str(work / "quantize.safetensors"))
    rows = []
    for preset in args.presets.split(","):
        src = work / preset
        if not (src / "config.json").exists():
            assert cli("fixture", preset, src).returncode == 0
        exports = {}
        for fmt in ("nvfp4", "nvfp4-ct"):
            exports[fmt] = work / f"{preset}-{fmt}"
            if not (exports[fmt] / "model.safetensors.index.json").exists():
                r = cli("export", src, exports[fmt], "--format", fmt, "--overwrite")
                assert r.returncode == 0, r.stderr
        mo, ct = ours(exports["nvfp4"]), ours(exports["nvfp4-ct"])
        print(f"{preset}: {len(mo)} NVFP4 weights (ModelOpt layout), {len(ct)} (compressed-tensors)")
        rows.append(compare(f"{preset} compressed-tensors (bf16, as it returns)", ct_decode(exports["nvfp4-ct"], ct),
                            ct, cast=lambda x: x.to(torch.bfloat16)))
        rows.append(compare(f"{preset} MLX nvfp4", mlx_decode(exports["nvfp4"], mo), mo))
        if py is not None:
            out = work / f"{preset}-modelopt.safetensors"
            subprocess.run([str(py), "-c", _MODELOPT_SCRIPT, str(exports["nvfp4"]), str(work / "quantize.safetensors"),
                            str(out)], check=True)
            from safetensors.torch import load_file

            res = load_file(out)
            rows.append(compare(f"{preset} nvidia-modelopt NVFP4QTensor.dequantize",
                                {n: res["deq:" + n] for n in mo}, mo))
    if py is not None:  # ModelOpt's quantizer against ours, from bf16 (the amax rule)
        same = []
        for k, x in rand.items():
            packed, block, s2 = nvfp4.quantize_nvfp4(x, name=k)
            same.append((torch.equal(res["q:" + k], packed), torch.equal(res["s:" + k].view(torch.uint8),
                                                                          block.view(torch.uint8)),
                         torch.equal(res["s2:" + k], s2)))
        print(json.dumps({"quantizer": "nvidia-modelopt NVFP4QTensor.quantize vs kconvert", "weights": len(same),
                          "codes_equal": sum(a for a, _, _ in same), "block_scales_equal": sum(b for _, b, _ in same),
                          "scale_2_equal": sum(c for _, _, c in same)}))
    print("\n| decoder | NVFP4 weights | bit-exact | max abs diff |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['decoder']} | {r['tensors']} | {r['bit_exact']} | {r['max_abs_diff']:.3g} |")


if __name__ == "__main__":
    main()
