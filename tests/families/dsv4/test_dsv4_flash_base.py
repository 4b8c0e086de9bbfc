"""DeepSeek-V4-Flash-Base as released (`tiny-dsv4-flash-base`): `expert_dtype: fp8`, every quantized linear, routed
experts included, FP8 128 x 128 with a float32 `.scale`. Its scales are read as the float32 they are (read as e8m0,
the values change: the check fails), it inspects, shards (none; fp8 with every FP8 block copied; fp4 and int4 from its
FP8 experts) and verifies against the reference; a `.scale` whose dtype contradicts the `expert_dtype` is read by its
stored dtype with one warning naming it (docs/BAD_INPUT.md)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from helpers import cli_here, verify_json
from kconvert.source.checkpoint import Checkpoint


def stored(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def decoded(tensors: dict, name: str) -> torch.Tensor:
    """An FP8 128 x 128 weight's values from its stored bytes, by plain arithmetic on the `.scale` as stored."""
    w, s = tensors[name], tensors[name[: -len(".weight")] + ".scale"]
    s = s.view(torch.uint8).float().sub(127).exp2() if s.dtype == torch.float8_e8m0fnu else s.float()
    return w.float() * s.repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)[:, : w.shape[1]]


@pytest.mark.parametrize("preset,scale_dtype", [("tiny-dsv4-flash-base", torch.float32),
                                                ("tiny-dsv4-flash", torch.float8_e8m0fnu)])
def test_scales_are_read_as_the_dtype_they_are_stored_in(checkpoint, preset, scale_dtype):
    src = checkpoint(preset)
    tensors, ck = stored(src), Checkpoint.open(src)
    fp8 = [n for n, t in tensors.items() if t.dtype == torch.float8_e4m3fn]
    assert len(fp8) > 20 and {tensors[n[: -len(".weight")] + ".scale"].dtype for n in fp8} == {scale_dtype}
    assert [n for n in fp8 if not torch.equal(ck.read(n, dtype=torch.float32), decoded(tensors, n))] == []
    if scale_dtype == torch.float32:  # not powers of two: an e8m0 reading (or a cast through it) changes them
        s = tensors["layers.2.ffn.experts.5.w3.scale"]
        assert not torch.equal(s.to(torch.float8_e8m0fnu).float(), s)


def test_flash_base_is_the_release_layout(checkpoint):
    src = checkpoint("tiny-dsv4-flash-base")
    config = json.loads((src / "config.json").read_text())
    assert config["expert_dtype"] == "fp8" and "scale_fmt" not in config["quantization_config"]
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    flash, base = Checkpoint.open(checkpoint("tiny-dsv4-flash")), Checkpoint.open(src)
    assert set(flash.logical) == set(base.logical)
    assert base.logical["layers.3.ffn.experts.7.w2.weight"].format == "block_fp8"  # FP8 experts (FP4 in Flash)
    bf16 = Checkpoint.open(checkpoint("tiny-dsv4"))
    for name in ("layers.3.ffn.experts.7.w2.weight", "layers.1.attn.wq_b.weight", "mtp.0.h_proj.weight"):
        a, b = bf16.read(name, dtype=torch.float32), base.read(name, dtype=torch.float32)
        assert (a - b).abs().max() <= 0.07 * a.abs().max(), name  # e4m3 with float32 scales: ~2^-4 relative
    r = cli_here("inspect", src, "--json")
    assert r.returncode == 0 and not r.stderr, r.stderr
    summary = json.loads(r.stdout)
    assert summary["family"] == "deepseek_v4" and summary["warnings"] == []
    assert {(f["format"], f["dtype"]) for f in summary["formats"]} >= {("block_fp8", "F8_E4M3")}


@pytest.fixture(scope="module")
def shards(checkpoint, tmp_path_factory):
    d = tmp_path_factory.mktemp("flash-base")
    src = checkpoint("tiny-dsv4-flash-base")
    for args in [("shard", src, d / q, "--tp", 1, "--quant", q) for q in ("none", "fp8", "fp4", "int4")] + \
            [("reference", src, "--out", d / "ref.safetensors")]:
        r = cli_here(*args)
        assert r.returncode == 0, r.stderr
    return d


def transforms(converted) -> set[str]:
    out = set()
    for f in converted.glob("rank-*/tensors.json"):
        doc = json.loads(f.read_text())
        i = doc["columns"].index("transform")
        out.update(row[i] for row in doc["tensors"] if ".scale" not in row[0])
    return out


@pytest.mark.parametrize("quant", ["none", "fp8", "fp4", "int4"])
def test_shards_verify_against_the_reference(shards, quant):
    """Every conversion is faithful (the engine runs exactly what it stores); fp8 copies every FP8 block, so it costs
    nothing against the release; none rounds float32-scaled values to bf16 and fp4 / int4 re-quantize the FP8
    experts, whose cost on these random weights is the schemes' (reported, not judged here)."""
    r, rep = verify_json(shards / quant, shards / "ref.safetensors")
    assert rep is not None and rep["faithfulness"]["verdict"] == "PASS", r.stderr
    assert rep["faithfulness"]["overall"]["mean_kld"] < 1e-6
    if quant == "fp8":
        assert r.returncode == 0 and rep["cost"]["overall"]["same_top1_pct"] == 100.0
        assert rep["cost"]["overall"]["mean_kld"] < 1e-6
        assert transforms(shards / quant) == {"copy", "fp8_copy"}


@pytest.mark.parametrize("preset,relabel,stored_as", [("tiny-dsv4-flash-base", "fp4", "F32"),
                                                      ("tiny-dsv4-flash", "fp8", "F8_E8M0")])
def test_a_scale_contradicting_expert_dtype_is_read_as_stored_with_a_warning(checkpoint, tmp_path, preset, relabel,
                                                                             stored_as):
    """The header makes a scale's dtype unambiguous, so it is read as stored (the values of the consistent source);
    `inspect`, `shard` and `export` each say once which tensor vLLM would misread, and the export is consistent."""
    src = tmp_path / "src"
    shutil.copytree(checkpoint(preset), src)
    config = json.loads((src / "config.json").read_text())
    config["expert_dtype"] = relabel
    (src / "config.json").write_text(json.dumps(config))
    for args in (("inspect", src), ("shard", src, tmp_path / "tp1", "--tp", 1, "--quant", "none"),
                 ("export", src, tmp_path / "fp8", "--format", "fp8-block")):
        r = cli_here(*args)
        warnings = [line for line in r.stderr.splitlines() if "warning" in line]
        assert r.returncode == 0 and len(warnings) == 1, (args[0], r.stderr)
        assert f"is {stored_as}" in warnings[0] and f"expert_dtype {relabel!r}" in warnings[0], warnings
        assert ".scale" in warnings[0].split(" is ")[0]  # the tensor named
    good, relabelled = Checkpoint.open(checkpoint(preset)), Checkpoint.open(src)
    name = "layers.1.attn.wq_b.weight"
    assert torch.equal(good.read(name, dtype=torch.float32), relabelled.read(name, dtype=torch.float32))
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert config["expert_dtype"] == {"F32": "fp8", "F8_E8M0": "fp4"}[stored_as]  # by what is stored, not the label
    assert not cli_here("inspect", tmp_path / "fp8").stderr
