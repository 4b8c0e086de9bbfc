"""The engine across tp x pp ranks (issue 15): tp 2 x pp 2 and tp 1 x pp 4 conversions give the reference's
logits (as tp 1 does), with and without micro-batched prefill; chat, `load --warmup` and `verify` (per
layer, attribution on another stage) run them; two torchrun "nodes" over the loopback interface run
tp 2 x pp 2 together; a world that does not match the layout is one line naming the launch to use.

One 4-layer tiny-k25-dsv32 (the presets have 3 layers: too few for 4 stages) and one conversion per layout,
shared by the module. fp32 compute; fresh random prompts every run (the seed is in the failure message)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import ROOT, run_cli
from helpers import shard_job
from kconvert.convert.shard.job import shard

LAYOUTS = {"tp1": (1, 1), "tp2-pp2": (2, 2), "tp1-pp4": (1, 4)}


@pytest.fixture(scope="module")
def src(checkpoint):
    """tiny-k25-dsv32 with 4 decoder layers, written by the fixture code from transformers' own model."""
    return checkpoint("tiny-k25-dsv32-4l")


@pytest.fixture(scope="module")
def conv(src, tmp_path_factory):
    """conv(name) -> Path of the conversion of `src` with LAYOUTS[name] (made once per module)."""
    root, done = tmp_path_factory.mktemp("pp-conv"), {}

    def get(name: str) -> Path:
        if name not in done:
            tp, pp = LAYOUTS[name]
            shard(shard_job(src, root / name, tp=tp, pp=pp))
            done[name] = root / name
        return done[name]

    return get


@pytest.fixture(scope="module")
def reference(src):
    from transformers.models.kimi_k25 import Kimi_K25ForConditionalGeneration

    return Kimi_K25ForConditionalGeneration.from_pretrained(str(src), dtype=torch.float32).eval()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, *args, nnodes: int = 1, node_rank: int = 0, port: int | None = None) -> list[str]:
    nodes = ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--master-addr", "127.0.0.1",
             "--master-port", str(port or free_port())]
    return [sys.executable, "-m", "torch.distributed.run", *nodes, "--nproc-per-node", str(nproc), *map(str, args)]


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}  # loopback: the two "nodes" of one machine
LENGTH, DECODE = 40, 3


def check(out: Path, seed: int, save: Path, chunk: int | str = 16) -> list:
    """engine.runtime.tp_check on `out`: prefill LENGTH tokens (in micro-batches of `chunk`), then DECODE single steps
    (chunk "16,0": both, one after the other on the one loaded model, saved as {chunk: logits})."""
    return ["-m", "engine.runtime.tp_check", out, "--seed", seed, "--length", LENGTH, "--decode", DECODE, "--chunk", chunk,
            "--save", save]


def ref_logits(reference, seed: int) -> torch.Tensor:
    from test_engine_logits import indexer_ties_by_position

    ids = torch.randint(0, 768, (1, LENGTH + DECODE), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad(), indexer_ties_by_position():
        return reference(input_ids=ids).logits


def mean_kld(ref: torch.Tensor, got: torch.Tensor) -> float:
    return torch.nn.functional.kl_div(got.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                                      reduction="none").sum(-1).mean().item()


@pytest.mark.parametrize("layout", ["tp2-pp2", "tp1-pp4"])
def test_tp_pp_logits_match_the_reference_as_tp1_does(layout, conv, reference, tmp_path):
    from engine.runtime.tp_check import run

    seed = int.from_bytes(os.urandom(4), "little")
    tp, pp = LAYOUTS[layout]
    save = tmp_path / "logits.pt"  # micro-batched prefill (3 chunks), then the prompt in one piece: one launch
    p = subprocess.run(torchrun(tp * pp, *check(conv(layout), seed, save, "16,0")), cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    got = torch.load(save)
    assert sorted(got) == [0, 16], got.keys()
    ref = ref_logits(reference, seed)
    tp1 = run(conv("tp1"), seed, LENGTH, DECODE)
    assert got[16].shape == tp1.shape == ref.shape
    for chunk, logits in got.items():
        assert mean_kld(ref, logits) < 1e-5, f"{layout} chunk {chunk}: KLD {mean_kld(ref, logits):.3g} (seed {seed})"
        err = (logits - tp1).abs().max().item()
        assert err <= 1e-4 * tp1.abs().max().item(), f"{layout} chunk {chunk} vs tp1: max |Δ| {err:.3g} (seed {seed})"
    assert mean_kld(ref, tp1) < 1e-5


def test_two_nodes_over_loopback_run_tp2_pp2(conv, tmp_path):
    """Two torchrun launches, --nnodes 2, 2 ranks each (node 0: stage 0, node 1: stage 1), one rendezvous."""
    from engine.runtime.tp_check import run

    seed = int.from_bytes(os.urandom(4), "little")
    save, port = tmp_path / "two-nodes.pt", free_port()
    nodes = [subprocess.Popen(torchrun(2, *check(conv("tp2-pp2"), seed, save), nnodes=2, node_rank=i, port=port),
                              cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in (0, 1)]
    outs = [n.communicate(timeout=600) for n in nodes]
    for i, (n, (_, err)) in enumerate(zip(nodes, outs)):
        assert n.returncode == 0, f"node {i}: {err[-3000:]}"
    got, tp1 = torch.load(save), run(conv("tp1"), seed, LENGTH, DECODE)
    err = (got - tp1).abs().max().item()
    assert got.shape == tp1.shape and err <= 1e-4 * tp1.abs().max().item(), f"max |Δ| {err:.3g} (seed {seed})"


def test_a_world_that_does_not_match_the_layout_is_one_line(conv):
    p = subprocess.run([sys.executable, "-m", "engine.runtime.tp_check", conv("tp2-pp2"), "--save", "/dev/null"], cwd=ROOT,
                       env=ENV, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    line, = [l for l in p.stderr.splitlines() if l.strip()]
    assert "kconvert.json" in line and "tp 2 x pp 2 = 4 ranks but 1" in line and "--nproc-per-node 4" in line, line


def test_a_stage_builds_only_its_layers_and_their_cache(conv):
    """Stage 1 of 2 (tp 1): layers 2-3, the final norm and head; no embeddings, no vision tower; its KV
    cache holds 2 layers. (Built in-process from the tp-1 files: one rank of a pp-2 run needs no peers
    to load.)"""
    from engine.model import Model
    from kconvert.distributed import Group
    from kconvert.load.loader import open_converted

    c = open_converted(conv("tp1"))
    model = Model(c.config, c.family, Group(rank=1, world=2, tp=1, pp=2), stages=[[0, 1], [2, 3]])
    for unit, tensors in c.stream():
        model.take_unit(unit, tensors)
    assert list(model.layers) == ["2", "3"]
    stack = model.text.model
    assert stack.embed_tokens is None and model.vision is None and stack.norm is not None and model.text.lm_head is not None
    cache = model.new_cache(1, 16)
    assert len(cache.layers) == 2 and model.slot == {2: 0, 3: 1}


def test_chat_with_an_image_under_tp2_pp2_answers_as_tp1(conv, image_file):
    """`python -m engine.chat` starts the 4 ranks itself; the image is read by rank 0, the vision tower runs
    on the first stage, tokens are sampled on the last; greedy answers equal tp 1's."""
    def answer(out):
        p = subprocess.run([sys.executable, "-m", "engine.chat", out, "--prompt", "What is in this picture?",
                            "--image", image_file, "--max-new-tokens", "8", "--dtype", "fp32"],
                           cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        *text, timing = p.stdout.strip().splitlines()
        assert "TTFT" in timing and "8 tokens" in timing, p.stdout
        return "\n".join(text)

    assert answer(conv("tp2-pp2")) == answer(conv("tp1"))


def test_load_warmup_runs_every_stage(conv):
    r = run_cli("load", conv("tp2-pp2"), "--device", "cpu", "--warmup", "1", "--json", env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(r.stdout)
    assert rep["rank"] == 0 and rep["stage"] == 0 and rep["seconds"]["warmup"] > 0


def scale_tensor(out: Path, rel: str, name: str, factor: float) -> None:
    """Multiply one stored tensor and re-record the file's and tensors' checksums (damage only numbers catch)."""
    import zlib

    from safetensors.torch import load_file, save_file

    from helpers import header_offsets, read_meta, rewrite_catalog

    tensors = load_file(out / rel)
    tensors[name] = tensors[name] * factor
    save_file(tensors, out / rel, metadata={"format": "pt"})
    data = (out / rel).read_bytes()
    start, header = header_offsets(out / rel)
    meta = read_meta(out)
    meta["files"][rel].update(bytes=len(data), crc32=f"{zlib.crc32(data):08x}")
    for t in meta["tensors"]:
        if t["file"] == rel:
            lo, hi = header[t["name"]]["data_offsets"]
            t["crc32"] = f"{zlib.crc32(data[start + lo:start + hi]):08x}"
    rewrite_catalog(out, meta)


@pytest.fixture(scope="module")
def ref_file(src, tmp_path_factory):
    out = tmp_path_factory.mktemp("pp-ref") / "ref.safetensors"
    run_cli("reference", src, "--out", out, "--hidden-states", check=True)
    return out


def test_verify_runs_tp1_pp4_per_layer(conv, ref_file):
    """Every stage's hidden states reach the writer: one curve entry per layer, all at fp32 noise."""
    r = run_cli("verify", conv("tp1-pp4"), "--reference", ref_file, "--per-layer", "--json")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rep = json.loads(r.stdout)
    assert rep["verdict"] == "PASS" and rep["cost"]["overall"]["mean_kld"] < 1e-5
    curve = rep["cost"]["per_layer"]
    assert len(curve) == 5 and max(c["rel_error"] for c in curve) < 1e-4, curve
    # --kv-dtype reaches the spawned ranks (an argument now, not an environment variable): fp8 KV adds error
    fp8 = json.loads(run_cli("verify", conv("tp1-pp4"), "--reference", ref_file, "--kv-dtype", "fp8", "--json").stdout)
    assert fp8["cost"]["overall"]["mean_kld"] > 10 * max(rep["cost"]["overall"]["mean_kld"], 1e-9), fp8["cost"]


def test_verify_locates_damage_on_the_last_stage(conv, ref_file, tmp_path):
    """o_proj of layer 3 (stage 1 of tp 2 x pp 2) scaled on both its ranks: verify FAILs at layer 3 and the
    attribution, computed on stage 1, names the tensor."""
    import shutil

    out = tmp_path / "damaged"
    shutil.copytree(conv("tp2-pp2"), out)
    name = "language_model.model.layers.3.self_attn.o_proj.weight"
    for rank in (2, 3):
        scale_tensor(out, f"rank-00{rank}/layer-0003.safetensors", name, 8.0)
    r = run_cli("verify", out, "--reference", ref_file, "--per-layer", "--json")
    rep = json.loads(r.stdout)
    assert r.returncode == 1 and rep["faithfulness"]["verdict"] == "FAIL", r.stderr[-2000:]
    assert rep["first_fault_layer"] == 3, rep["faithfulness"]["per_layer"]
    assert rep["attribution"][0]["layer"] == 3 and rep["attribution"][1]["tensor"] == name, rep["attribution"][:3]
