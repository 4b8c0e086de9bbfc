"""Damage that the integrity check cannot see: tensors of a converted directory changed and their
checksums re-recorded, so only verify's numbers can tell. CASES are the faults verify must FAIL as
"the conversion is wrong" and locate, on an fp8 conversion of tiny-k25-dsv32-trained (tests/verify/test_verify.py,
bench/verify_damage.py)."""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from kconvert.disk_format.catalog import Catalog

P = "language_model.model.layers."  # tiny-k25-dsv32's decoder layers


def rewrite(out: str | Path, rel: str, mutate: Callable[[dict], None]) -> None:
    """Change the tensors of converted file `rel` in place, then re-record its size and checksums (and
    kconvert.json's digest): a consistent-looking directory, as a tool that knows the format leaves it."""
    from safetensors.torch import load_file, save_file

    out = Path(out)
    tensors = load_file(out / rel)
    mutate(tensors)
    save_file(tensors, out / rel, metadata={"format": "pt"})
    cat = Catalog.read(out)
    data = (out / rel).read_bytes()
    cat.doc["files"][rel].update(bytes=len(data), crc32=f"{zlib.crc32(data):08x}")
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    cat.doc["tensors"] = cat.tensors  # whole again: `write` splits it into the per-rank lists anew
    for t in cat.doc["tensors"]:
        if t["file"] == rel:
            lo, hi = header[t["name"]]["data_offsets"]
            t["crc32"] = f"{zlib.crc32(data[8 + n + lo:8 + n + hi]):08x}"
    cat.write(out)


def files_holding(out: str | Path, name: str) -> list[str]:
    """The converted files (every rank's slice) that hold tensor `name`."""
    return sorted({t["file"] for t in Catalog.read(out).tensors if t["name"] == name})


def scale_up(out: str | Path, weight: str, factor: float) -> None:
    """Multiply `weight`'s fp8 scales by `factor` on every rank: the layer computes with a wrong scale."""
    name = weight + "_scale_inv"
    for rel in files_holding(out, name):
        rewrite(out, rel, lambda t: t.__setitem__(name, t[name] * factor))


def flip_row(out: str | Path, weight: str, row: int = 5) -> None:
    """Negate one output row of the last rank's slice of fp8 `weight`: a fault far below fp8's noise."""
    def flip(t):
        w = t[weight].float()
        w[row] = -w[row]
        t[weight] = w.to(torch.float8_e4m3fn)

    rewrite(out, files_holding(out, weight)[-1], flip)


def swap_expert_ranks(out: str | Path, layer: int) -> None:
    """Exchange rank 0's and rank 1's routed experts of `layer` (tp 2): what a wrong rank order does."""
    from safetensors.torch import load_file

    rels = [f"rank-00{r}/layer-{layer:04d}.safetensors" for r in (0, 1)]
    held = [load_file(Path(out) / rel) for rel in rels]
    n = sum(1 for k in held[0] if k.endswith(".up_proj.weight") and ".mlp.experts." in k)  # experts per rank

    def renumber(tensors: dict, shift: int) -> dict:
        moved = {}
        for k, v in tensors.items():
            if ".mlp.experts." in k:
                head, rest = k.split(".mlp.experts.")
                e, tail = rest.split(".", 1)
                moved[f"{head}.mlp.experts.{int(e) + shift}.{tail}"] = v
        return moved

    into = (renumber(held[1], -n), renumber(held[0], n))
    for rel, moved in zip(rels, into):
        rewrite(out, rel, lambda t, m=moved: t.update(m))


def randomize(out: str | Path, name: str, seed: int = 0) -> None:
    """Replace tensor `name` (each rank's slice) by random values of its shape, scale and dtype: a weight loaded from
    nowhere (a draft head on random weights, vLLM #43456)."""
    gen = torch.Generator().manual_seed(seed)

    def fill(t):
        w = t[name].float()
        t[name] = (torch.randn(w.shape, generator=gen) * w.std()).to(t[name].dtype)

    for rel in files_holding(out, name):
        rewrite(out, rel, fill)


def zero(out: str | Path, *names: str) -> None:
    """Zero tensors `names` (each rank's slice): a weight a loader skipped (a draft head without one of its
    experts, vLLM #43459)."""
    for name in names:
        for rel in files_holding(out, name):
            rewrite(out, rel, lambda t, n=name: t.__setitem__(n, torch.zeros_like(t[n])))


@dataclass(frozen=True)
class Damage:
    apply: Callable[[Path], None]
    layer: int  # the first faulty layer verify --per-layer must name
    tensor: str | None  # the tensor attribution must rank first (None: not a single tensor's fault)
    min_tp: int = 1  # the fewest ranks the case needs


EXPERT = f"{P}2.mlp.experts.0.up_proj.weight"  # an expert the held-out prompts route to (layer 2 uses few)
O_PROJ = f"{P}1.self_attn.o_proj.weight"
Q_B = f"{P}1.self_attn.q_b_proj.weight"
CASES = {
    "one expert x30": Damage(lambda out: scale_up(out, EXPERT, 30), 2, EXPERT),  # a corrupted expert, not noise
    "one layer's scales x8": Damage(lambda out: scale_up(out, O_PROJ, 8), 1, O_PROJ),
    "experts swapped between ranks": Damage(lambda out: swap_expert_ranks(out, 1), 1, None, min_tp=2),
    "one row sign-flipped": Damage(lambda out: flip_row(out, Q_B), 1, Q_B),
}


# --------------------------------------------------------------------------- exports (Hugging Face layout)


def rewrite_export(out: str | Path, name: str, mutate: Callable[[dict], None]) -> None:
    """Change the export file holding stored tensor `name` in place and re-record its size and CRC-32 in
    the index (`kconvert_files`): an export that looks whole, wrong only in its numbers."""
    from safetensors.torch import load_file, save_file

    out = Path(out)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    rel = index["weight_map"][name]
    tensors = load_file(out / rel)
    mutate(tensors)
    save_file(tensors, out / rel, metadata={"format": "pt"})
    data = (out / rel).read_bytes()
    index["metadata"].get("kconvert_files", {})[rel] = {"bytes": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def scale_export(out: str | Path, weight: str, factor: float) -> None:
    """Multiply the stored scales of export weight `weight` (X.weight_scale or X.weight_scale_inv)."""
    index = json.loads((Path(out) / "model.safetensors.index.json").read_text())["weight_map"]
    name = next(weight + s for s in ("_scale", "_scale_inv") if weight + s in index)
    rewrite_export(out, name, lambda t: t.__setitem__(name, (t[name].float() * factor).to(t[name].dtype)))


def swap_export_rows(out: str | Path, weight: str, a: int = 1, b: int = 6) -> None:
    """Exchange two output rows of export weight `weight`'s stored values (packed int4 words, int8 or e4m3
    codes), scales untouched: each row keeps a plausible scale, only the faithfulness check can tell."""
    index = json.loads((Path(out) / "model.safetensors.index.json").read_text())["weight_map"]
    name = weight + "_packed" if weight + "_packed" in index else weight

    def swap(t):
        w = t[name].clone()
        w[[a, b]] = w[[b, a]]
        t[name] = w

    rewrite_export(out, name, swap)


EXPORT_EXPERT = "language_model.model.layers.1.mlp.experts.3.down_proj.weight"  # quantized by every format
EXPORT_CASES = {
    "one expert's scales x2": lambda out: scale_export(out, EXPORT_EXPERT, 2.0),
    "two rows of one expert swapped": lambda out: swap_export_rows(out, EXPORT_EXPERT),
}
