"""`kconvert shard`: DeepSeek-layout slicing, FP8/INT8 accuracy, lossless FP8 passthrough, resume after
SIGKILL, torchrun = single process, and the bad inputs of issue 3."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import ROOT, assert_one_line_error, cli_here, load_source, read_meta, run_cli


def rank_tensors(out: Path, rank: int) -> dict[str, torch.Tensor]:
    d: dict[str, torch.Tensor] = {}
    for f in sorted((out / f"rank-{rank:03d}").glob("*.safetensors")):
        d.update(load_file(f))
    return d


def deepseek_slice(name: str, w: torch.Tensor, rank: int, tp: int, n_experts: int) -> torch.Tensor | None:
    """Independent statement of DeepSeek inference/convert.py's layout (by tensor name, not our manifest)."""
    if ".mlp.experts." in name:
        e = int(name.split(".mlp.experts.")[1].split(".")[0])
        per = n_experts // tp
        return w if rank * per <= e < (rank + 1) * per else None
    dim0 = ("embed_tokens", "lm_head", "q_b_proj", "kv_b_proj", "gate_proj", "up_proj")
    dim1 = ("o_proj", "down_proj")
    leaf = name.rsplit(".", 2)[-2]
    if "indexer" in name or leaf not in dim0 + dim1 or name.endswith("mlp.gate.weight"):
        return w
    return w.chunk(tp, dim=0 if leaf in dim0 else 1)[rank]


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_slices_match_deepseek_layout(checkpoint, tmp_path, tp):
    src = checkpoint("tiny-dsv32")
    out = tmp_path / f"tp{tp}"
    run_cli("shard", src, out, "--tp", tp, "--quant", "none", check=True)
    source = load_source(src)
    n_experts = json.loads((src / "config.json").read_text())["n_routed_experts"]
    for rank in range(tp):
        got = rank_tensors(out, rank)
        want = {n: s for n, w in source.items() if (s := deepseek_slice(n, w, rank, tp, n_experts)) is not None}
        assert set(got) == set(want), (rank, sorted(set(got) ^ set(want))[:5])
        for name, w in want.items():
            assert got[name].dtype == w.dtype and torch.equal(got[name], w), name
    meta = json.loads((out / "kconvert.json").read_text())
    assert meta["layout"]["tp"] == tp and meta["quantization"]["scheme"] == "none"
    assert all((out / f).stat().st_size == r["bytes"] for f, r in meta["files"].items())
    assert (out / "tiktoken.model").exists() and (out / "config.json").exists()


def expand_blocks(scale: torch.Tensor, shape, block=128) -> torch.Tensor:
    return torch.kron(scale, torch.ones(block, block))[: shape[0], : shape[1]]


@pytest.mark.parametrize("quant,scale_format", [("fp8", "fp32"), ("fp8", "ue8m0"), ("int8", "fp32")])
def test_quantized_round_trip_error_bounds(checkpoint, tmp_path, quant, scale_format):
    src = checkpoint("tiny-k25-dsv32")
    out = tmp_path / quant
    run_cli("shard", src, out, "--tp", 2, "--quant", quant, "--scale-format", scale_format, check=True)
    source = load_source(src)
    meta = read_meta(out)
    quantized = 0
    for rank in range(2):
        got = rank_tensors(out, rank)
        for entry in (t for t in meta["tensors"] if t["rank"] == rank):
            name = entry["name"]
            if name.endswith("_scale_inv") or name.endswith("_scale"):
                continue
            w = source[name].float()
            if entry["slice"]:
                dim, a, b = entry["slice"]
                w = w.narrow(dim, a, b - a)
            q = got[name]
            if entry["transform"] == "copy":
                assert torch.equal(q.float(), w), name
                continue
            quantized += 1
            if quant == "fp8":
                assert q.dtype == torch.float8_e4m3fn
                s = got[name + "_scale_inv"]
                if scale_format == "ue8m0":
                    assert torch.equal(torch.log2(s), torch.log2(s).round()), name
                deq = q.float() * expand_blocks(s, q.shape)
                # e4m3: 3 mantissa bits -> relative step 2^-3 of the element; block amax maps to <= 448
                amax = expand_blocks(s, q.shape) * 448
                assert ((deq - w).abs() <= w.abs() * 2**-4 + amax * 2**-9 * (2 if scale_format == "ue8m0" else 1)
                        + 1e-12).all(), name
            else:
                assert q.dtype == torch.int8
                s = got[name + "_scale"]
                assert s.shape == (q.shape[0], 1)
                deq = q.float() * s
                assert ((deq - w).abs() <= s / 2 + 1e-7).all(), name
                assert torch.allclose(s.squeeze(1), w.abs().amax(1) / 127, rtol=1e-6)
    assert quantized > 50
    kept = {t["name"] for t in meta["tensors"] if t["transform"] == "copy"}
    assert any("embed_tokens" in n for n in kept) and any("weights_proj" in n for n in kept)
    assert any("vision_tower" in n for n in kept) and any("mlp.gate.weight" in n for n in kept)


def test_fp8_source_passthrough_is_lossless(checkpoint, tmp_path):
    src = checkpoint("tiny-k25-dsv32-fp8")
    out = tmp_path / "fp8"
    run_cli("shard", src, out, "--tp", 2, "--quant", "fp8", check=True)
    source = load_source(src)
    meta = read_meta(out)
    copies = [t for t in meta["tensors"] if t["transform"] == "fp8_copy" and t["dtype"] == "F8_E4M3"]
    assert len(copies) > 50
    for rank in range(2):
        got = rank_tensors(out, rank)
        for t in (c for c in copies if c["rank"] == rank):
            w, s = source[t["name"]], source[t["name"] + "_scale_inv"]
            if t["slice"]:
                dim, a, b = t["slice"]
                w, s = w.narrow(dim, a, b - a), s.narrow(dim, a // 128, -(-b // 128) - a // 128)
            assert torch.equal(got[t["name"]].view(torch.uint8), w.view(torch.uint8)), t["name"]
            assert torch.equal(got[t["name"] + "_scale_inv"], s), t["name"]
    bad = run_cli("shard", src, tmp_path / "tp4", "--tp", 4, "--quant", "fp8")
    assert_one_line_error(bad, "tp degrees that keep blocks whole: 1, 2", "--requantize")
    assert not (tmp_path / "tp4" / "kconvert.json").exists()
    run_cli("shard", src, tmp_path / "tp4", "--tp", 4, "--quant", "fp8", "--requantize", "--overwrite", check=True)


def test_int4_source_is_dequantized_then_requantized(checkpoint, tmp_path):
    src = checkpoint("tiny-k25-dsv32-int4")
    out = tmp_path / "int8"
    run_cli("shard", src, out, "--tp", 2, "--quant", "int8", check=True)
    meta = read_meta(out)
    experts = [t for t in meta["tensors"] if t["component"] == "routed_experts" and t["dtype"] == "I8"]
    assert experts and all(not t["name"].endswith("weight_packed") for t in meta["tensors"])


def _tree(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_resume_after_sigkill_is_byte_identical(checkpoint, tmp_path):
    src = checkpoint("scale", size=160_000_000)
    ref, out = tmp_path / "ref", tmp_path / "out"
    args = ["--tp", "2", "--quant", "fp8"]
    run_cli("shard", src, ref, *args, check=True)
    cmd = [sys.executable, "-m", "cli.main", "shard", str(src), str(out), *args, "--json"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    journal = out / ".kconvert"
    while time.time() < deadline and proc.poll() is None:
        logs = list(journal.glob("done-*.jsonl")) if journal.exists() else []
        if logs and logs[0].read_text().count("\n") >= 2:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "kconvert.json").exists(), "killed too late: nothing to resume"
    again = run_cli("shard", src, out, *args, "--json", check=True)
    assert json.loads(again.stdout)["files_resumed"] >= 2
    assert _tree(out) == _tree(ref)


def test_torchrun_two_processes_match_one(checkpoint, tmp_path):
    src = checkpoint("tiny-k25-dsv32")
    one, two = tmp_path / "one", tmp_path / "two"
    alone = json.loads(run_cli("shard", src, one, "--tp", 2, "--quant", "int8", "--json", check=True).stdout)
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.run([str(torchrun), "--nproc-per-node", "2", "--master-port", "29517", "-m", "cli.main", "shard",
                           str(src), str(two), "--tp", "2", "--quant", "int8", "--json"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _tree(one) == _tree(two)
    both = json.loads(proc.stdout)  # rank 0's summary totals both processes' files and bytes
    assert both["processes"] == 2 and alone["processes"] == 1
    assert (both["files_written"], both["bytes_in"]) == (alone["files_written"], alone["bytes_in"])


def test_verify_files_names_damaged_file_and_tensor(checkpoint, tmp_path):
    out = tmp_path / "o"
    run_cli("shard", checkpoint("tiny-k25-dsv32"), out, "--tp", 2, check=True)
    assert run_cli("verify-files", out).returncode == 0
    meta = read_meta(out)
    target = next(t for t in meta["tensors"] if t["name"].endswith("kv_b_proj.weight") and t["rank"] == 1)
    path = out / target["file"]
    data = bytearray(path.read_bytes())
    from helpers import header_offsets

    start, header = header_offsets(path)
    lo, hi = header[target["name"]]["data_offsets"]
    data[start + (lo + hi) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    assert_one_line_error(run_cli("verify-files", out), target["file"], target["name"], "checksum")


# ------------------------------------------------------------------ bad input


def test_bad_inputs(checkpoint, tmp_path, copy_checkpoint):
    """Through the CLI's entry point in this process (cli_here): no interpreter start per case."""
    src = checkpoint("tiny-k25-dsv32")
    assert_one_line_error(cli_here("shard", src, tmp_path / "a", "--tp", 8), "4 attention heads", "1, 2, 4")
    assert not (tmp_path / "a").exists()
    r = cli_here("shard", src, tmp_path / "b", "--tp", 2, "--quant", "int3")
    assert r.returncode == 2 and "int3" in r.stderr
    assert_one_line_error(cli_here("shard", src, src / "out", "--tp", 2), "inside the source")
    assert_one_line_error(cli_here("shard", src, "/proc/kconvert-out", "--tp", 2), "/proc/kconvert-out")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert_one_line_error(cli_here("shard", src, other, "--tp", 2), "not empty")
    done = tmp_path / "done"
    assert cli_here("shard", src, done, "--tp", 1).returncode == 0
    assert_one_line_error(cli_here("shard", src, done, "--tp", 2), "different conversion", "--overwrite")
    assert cli_here("shard", src, done, "--tp", 1).returncode == 0  # same job again: already complete


def test_nan_in_source_refuses_to_quantize(checkpoint, copy_checkpoint, tmp_path):
    src = copy_checkpoint(checkpoint("tiny-k25-dsv32"))
    index = json.loads((src / "model.safetensors.index.json").read_text())
    name = "language_model.model.layers.1.self_attn.o_proj.weight"
    from helpers import header_offsets

    path = src / index["weight_map"][name]
    start, header = header_offsets(path)
    lo, _ = header[name]["data_offsets"]
    data = bytearray(path.read_bytes())
    data[start + lo: start + lo + 2] = b"\xc0\x7f"  # bf16 NaN
    path.write_bytes(bytes(data))
    r = run_cli("shard", src, tmp_path / "o", "--tp", 2, "--quant", "fp8")
    assert_one_line_error(r, name, "NaN")
    assert not (tmp_path / "o" / "kconvert.json").exists()


def test_ep1_splits_each_expert_over_all_ranks(checkpoint, tmp_path):
    src = checkpoint("tiny-dsv32")
    out = tmp_path / "ep1"
    run_cli("shard", src, out, "--tp", 2, "--ep", 1, check=True)
    source = load_source(src)
    meta = json.loads((out / "kconvert.json").read_text())
    assert meta["layout"]["experts"] == "split"
    for rank in range(2):
        got = rank_tensors(out, rank)
        for leaf, dim in (("gate_proj", 0), ("up_proj", 0), ("down_proj", 1)):
            name = f"model.layers.1.mlp.experts.7.{leaf}.weight"
            assert torch.equal(got[name], source[name].chunk(2, dim=dim)[rank]), name


@pytest.mark.parametrize("preset,quant", [("tiny-k25-dsv32", "none"), ("tiny-k25-dsv32", "int8"),
                                          ("tiny-k25-dsv32-fp8", "fp8")])
def test_recorded_crcs_are_the_bytes_on_disk(conversion, preset, quant):
    """Every file's and every tensor's CRC-32 in kconvert.json is zlib's of the bytes written, on every rank: a
    replicated tensor's is computed once and given to the other ranks' files, and must still be theirs."""
    import zlib

    from helpers import header_offsets
    from kconvert.disk_format.catalog import Catalog

    out = conversion(preset, tp=2, quant=quant)
    cat = Catalog.read(out)
    replicated = 0
    for rel, rec in cat.files.items():
        data = (out / rel).read_bytes()
        assert f"{zlib.crc32(data):08x}" == rec["crc32"], rel
        start, header = header_offsets(out / rel)
        for t in cat.tensors_in(rel):
            lo, hi = header[t["name"]]["data_offsets"]
            assert f"{zlib.crc32(data[start + lo:start + hi]):08x}" == t["crc32"], (rel, t["name"])
            replicated += rec["rank"] == 1 and t.get("slice") is None
    assert replicated  # rank 1 holds whole copies of replicated tensors (norms, q_a_proj, ...)
