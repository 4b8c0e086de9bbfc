"""Calibrated int4 (`shard --quant int4 --calibrate DATA`): the calibration data, the layer-by-layer GPTQ run
through the engine (better layer outputs than rounding with the same scales), what kconvert.json records,
tp-independence of the stored weights, resuming an interrupted run to the same bytes, and bad input.
Tiny: tiny-k25-dsv32 (random weights) with a few hundred calibration tokens; quality on trained weights is
bench/calibration_bench.py's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import assert_one_line_error, cli_here, one_thread
from kconvert.disk_format.catalog import Catalog
from helpers import shard_job
from kconvert.convert.shard.job import shard
from kconvert.errors import UsageError
from kconvert.source.calibration_data import calibration_windows

TOKENS, SEQ = 256, 64
SHARED = ("*shared_experts*",)  # calibrated too, and cut by tp 2 (rows and columns)


def _make(grid="kconvert"):
    from cli.calibrate_opts import calibration_factory

    return calibration_factory("stdlib", TOKENS, SEQ, 0, grid, (grid,))


def _shard(src, out, tp=2, calibrate=None):
    job = shard_job(src, out, tp=tp, quant="int4", force=SHARED, workers=1)
    return shard(job, calibrate=calibrate if calibrate is not None else _make())


@pytest.fixture(scope="module")
def calibrated(checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("calib") / "tp2"
    return out, _shard(checkpoint("tiny-k25-dsv32"), out)


def _files(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*.safetensors"))}


def _weights(out: Path) -> dict[str, torch.Tensor]:
    """Every calibrated weight, decoded from the stored codes and scales and its tp slices put together."""
    from kconvert.verify.stored_codes import stored_int4_pieces

    meta = Catalog.read(out).whole_doc()
    whole = {}
    for name, pieces in stored_int4_pieces(out, meta).items():
        whole[name] = torch.cat([w for _, w in sorted(pieces, key=lambda p: p[0][1])], dim=pieces[0][0][0]) \
            if pieces[0][0] else pieces[0][1]
    return whole


def test_windows_are_seeded_and_read_every_kind_of_data(tmp_path):
    (tmp_path / "a.txt").write_text("alpha beta gamma " * 40)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "b.md").write_text("delta " * 50)
    rows = [{"text": "one two three " * 20}, {"messages": [{"role": "user", "content": "hi " * 30}]}]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    encode = lambda t: list(t.encode())  # noqa: E731 (bytes as tokens: no tokenizer needed here)
    for data in ("a.txt", "d", "c.jsonl"):
        w1, rec1 = calibration_windows(str(tmp_path / data), encode, tokens=100, seq=16, seed=3)
        w2, rec2 = calibration_windows(str(tmp_path / data), encode, tokens=100, seq=16, seed=3)
        assert w1.shape == (7, 16) and torch.equal(w1, w2) and rec1 == rec2 and rec1["tokens"] == 112
    w3, rec3 = calibration_windows(str(tmp_path / "c.jsonl"), encode, tokens=100, seq=16, seed=4)
    assert not torch.equal(w1, w3) and rec3["seed"] == 4
    assert "<|im_user|>" in bytes(calibration_windows(str(tmp_path / "c.jsonl"), encode, 10**4, 16)[0].flatten().tolist()).decode()
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"txt": 1}\n')
    with pytest.raises(UsageError, match="line 2"):
        calibration_windows(str(tmp_path / "bad.jsonl"), encode)
    with pytest.raises(UsageError, match="fewer than one window"):
        calibration_windows(str(tmp_path / "a.txt"), encode, seq=10**6)


def test_gptq_layer_beats_rounding_and_is_what_shard_stores_at_tp2(calibrated, checkpoint, monkeypatch):
    """A MoE layer's output is closer to the unquantized layer's with GPTQ codes than with nearest codes
    (forced by giving every expert too few tokens), the scales being the same static ones; and the weights a
    tp 2 calibrated shard stores (cut by rows and by columns) are these whole-tensor codes times scales."""
    from engine.calibrate import layerwise as cal
    from kconvert.quant.gptq import GRIDS
    from kconvert.quant.policy import QuantPolicy
    from kconvert.source.checkpoint import Checkpoint
    from kconvert.source.tokenizer import load_kimi_tokenizer

    ck = Checkpoint.open(checkpoint("tiny-k25-dsv32"))
    enc = load_kimi_tokenizer(ck.root)
    windows, record = calibration_windows("stdlib", lambda t: enc.encode(t, allowed_special="all"), TOKENS, SEQ, seed=0)
    policy = QuantPolicy("int4", force=SHARED)
    with one_thread():
        gptq = cal.LayerCalibration(ck, windows, policy, GRIDS["kconvert"], record)
        got = gptq.layer(1)
        monkeypatch.setattr(cal, "MIN_EXPERT_TOKENS", 10**9)
        rtn = cal.LayerCalibration(ck, windows, policy, GRIDS["kconvert"], record)
        near = rtn.layer(1)
    assert got.keys() == near.keys() and len(got) == 48 + 3  # 16 experts x gate, up, down; the shared expert
    assert all(torch.equal(got[n][1], near[n][1]) for n in got)  # static scales
    changed = sum(int((got[n][0] != near[n][0]).sum()) for n in got) / sum(got[n][0].numel() for n in got)
    assert 0.02 < changed < 0.5
    a, b = gptq.figures[-1], rtn.figures[-1]  # layer 1 (layer 0, dense, has nothing to calibrate)
    assert a["experts_rounded_few_tokens"] == 0 and b["experts_rounded_few_tokens"] == 16
    assert a["output_rel_error"] < 0.9 * b["output_rel_error"], (a, b)
    stored = _weights(calibrated[0])
    for n, (codes, scale) in got.items():
        assert torch.equal(stored[n], codes.float() * scale.float().repeat_interleave(32, 1)), n


def test_calibrated_shard_records_its_calibration(calibrated):
    out, result = calibrated
    q = Catalog.read(out).doc["quantization"]
    assert q["calibration"]["method"] == "gptq" and q["calibration"]["tokens"] == TOKENS
    assert q["calibration"]["seq"] == SEQ and q["calibration"]["data"] == "stdlib"
    layers = result.details.calibration["layers"]
    assert [f["layer"] for f in layers] == [0, 1, 2] and layers[1]["calibrated"] == 48 + 3
    assert all(0 < f["output_rel_error"] < 0.1 for f in layers[1:]) and layers[0]["output_rel_error"] == 0


def test_sigkilled_calibration_resumes_to_the_same_bytes(calibrated, checkpoint, tmp_path):
    """SIGKILL once layer 2's input is kept (layer 1's files journalled or about to be): the same job resumes
    from a kept input, recomputing at most layers 1-2, and writes the bytes of an uninterrupted run."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from helpers import ROOT

    out = tmp_path / "killed"
    state = out / ".kconvert" / "calibration" / "input-0002.safetensors"
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "shard", str(checkpoint("tiny-k25-dsv32")), str(out), "--tp", "2",
                             "--quant", "int4", "--quantize", SHARED[0], "--workers", "1", "--calibrate", "stdlib",
                             "--calibration-tokens", str(TOKENS), "--calibration-seq", str(SEQ), "--json"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not state.exists() and proc.poll() is None:
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL and not (out / "kconvert.json").exists()
    r = _shard(checkpoint("tiny-k25-dsv32"), out)
    assert r.files_resumed > 0 and [f["layer"] for f in r.details.calibration["layers"]] in ([1, 2], [2])
    assert _files(out) == _files(calibrated[0])


def test_calibrate_bad_input_is_one_line(checkpoint, tmp_path):
    src = checkpoint("tiny-k25-dsv32")
    proc = cli_here("shard", src, tmp_path / "o1", "--tp", "1", "--quant", "fp8", "--calibrate", "stdlib")
    assert_one_line_error(proc, "--calibrate", "fp8")
    proc = cli_here("shard", src, tmp_path / "o2", "--tp", "1", "--quant", "int4", "--calibrate", str(tmp_path / "nope.txt"))
    assert_one_line_error(proc, "nope.txt", "not found")
    assert not (tmp_path / "o2" / "kconvert.json").exists()
    proc = cli_here("export", src, tmp_path / "o3", "--format", "w4a16", "--calibrate", "stdlib", "--calibration-grid", "kconvert")
    assert_one_line_error(proc, "--calibration-grid kconvert", "minmax, kimi")


def test_calibrated_w4a16_export_reads_back_in_compressed_tensors(checkpoint, tmp_path):
    """export --format w4a16 --calibrate: compressed-tensors' own decompressor reads every calibrated expert;
    the scales are the uncalibrated export's (static min-max), a share of the codes moved; the index records it."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    from cli.calibrate_opts import calibration_factory
    from helpers import load_source
    from kconvert.convert.export.job import ExportJob, export
    from kconvert.quant.packing import unpack_int32_words

    src = checkpoint("tiny-k25-dsv32")
    r = export(ExportJob(str(src), str(tmp_path / "gptq"), "w4a16"),
               calibrate=calibration_factory("stdlib", TOKENS, SEQ, 0, None, ("minmax", "kimi")))
    assert [f["layer"] for f in r.details.calibration["layers"]] == [0, 1, 2]
    export(ExportJob(str(src), str(tmp_path / "rtn"), "w4a16"))
    gptq, rtn = load_source(tmp_path / "gptq"), load_source(tmp_path / "rtn")
    index = json.loads((tmp_path / "gptq" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["kconvert_job"]["calibration"]["grid"] == "minmax"
    qc = json.loads((tmp_path / "gptq" / "config.json").read_text())["quantization_config"]
    group = qc["config_groups"]["group_0"]
    scheme = QuantizationScheme(targets=group["targets"], weights=group["weights"])
    compressor = BaseCompressor.load_from_registry(qc["format"])
    packed = [n for n in gptq if n.endswith(".weight_packed")]
    assert len(packed) == 96
    moved = 0
    for n in packed:
        stem = n.removesuffix("_packed")
        assert torch.equal(gptq[stem + "_scale"], rtn[stem + "_scale"]), n
        parts = {k: gptq[stem + "_" + k] for k in ("packed", "scale", "shape")}
        theirs = compressor.decompress({f"weight_{k}": v for k, v in parts.items()}, scheme)["weight"]
        codes = unpack_int32_words(parts["packed"], int(parts["shape"][1]))
        assert torch.equal(theirs.float(), (codes.float() * parts["scale"].float().repeat_interleave(32, 1))
                           .to(theirs.dtype).float()), n
        moved += int((gptq[n] != rtn[n]).sum())
    assert moved > 0


def test_torchrun_splits_the_experts_and_writes_the_bytes_of_one_process(calibrated, checkpoint, tmp_path):
    """Two processes under torchrun (CPU gloo): each computes the codes of its half of every layer's experts
    (expert e on process e % 2) and of the shared expert's linears, the codes go to both, each writes its own
    units; the files are byte for byte the single process's, and so are the layers' figures."""
    import os
    import socket
    import subprocess
    import sys

    from helpers import ROOT

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    out = tmp_path / "two"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", port,
                           "-m", "cli.main", "shard", str(checkpoint("tiny-k25-dsv32")), str(out), "--tp", "2", "--quant", "int4",
                           "--quantize", SHARED[0], "--workers", "1", "--calibrate", "stdlib", "--calibration-tokens",
                           str(TOKENS), "--calibration-seq", str(SEQ), "--json"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _files(out) == _files(calibrated[0])
    run = json.loads(proc.stdout)  # rank 0's summary
    assert run["processes"] == 2
    two, one = run["calibration"]["layers"], calibrated[1].details.calibration["layers"]
    # layers 1, 2: rank 0 has experts 0, 2, ..., 14 (8 x 3 weights) and the shared expert's 1st and 3rd linear
    assert [f["codes_computed_here"] for f in two] == [0, 26, 26]
    assert [f["codes_computed_here"] for f in one] == [0, 51, 51]
    same = lambda f: {k: v for k, v in f.items() if k not in ("seconds", "codes_computed_here")}  # noqa: E731
    assert list(map(same, two)) == list(map(same, one))


def test_calibration_memory_helpers_keep_the_numbers(checkpoint):
    """What bounds a calibrated run's memory changes no number: the engine's prefill blocks cut small along
    the queries (here to 8 queries, as calibration's budgets cut 8 sequences of 256) give the same layer
    output bit for bit; the MoE-input buffer is the concatenation (ids too, where given); the chunked error is
    the whole-tensor one; the in-place expert activation is what the expert's own forward gives down_proj."""
    from engine.calibrate import memory as mem
    from engine.calibrate import routing as calibrate_moe
    from engine.model import Model
    from kconvert.convert.shard.plan import unit_of
    from kconvert.disk_format.units import layer_unit
    from kconvert.distributed import Group
    from kconvert.family.engine_names import engine_keys
    from kconvert.source.checkpoint import Checkpoint

    ck = Checkpoint.open(checkpoint("tiny-k25-dsv32"))
    m = Model(ck.config, ck.family, Group(), "cpu", torch.float32)
    names = [n for n in ck.logical if unit_of(ck.info(n)) == layer_unit(1)]
    layer = m.build_layer(1, engine_keys(m.names, {n: ck.read(n, dtype=torch.float32) for n in names}), use_catalog=False)
    g = torch.Generator().manual_seed(5)
    x, ids = torch.randn(2, SEQ, m.cfg.hidden_size, generator=g), torch.randint(0, 1000, (2, SEQ), generator=g)

    def forward():
        cache = m.new_cache(2, SEQ)
        cos, sin = m.rotary(torch.arange(SEQ).expand(2, SEQ), m.dtype)
        with torch.no_grad():
            return layer.forward(x, 0, cache.layers[m.slot[1]], cos, sin, m.par, ids=ids)

    with one_thread():
        whole = forward()
        block = 2 * 8 * m.cfg.index_n_heads * SEQ  # 8 queries of 2 sequences a score block; gathers of 2
        with mem.small_prefill_blocks(score=block, gather=block):
            cut = forward()
    assert torch.equal(whole, cut)
    rows = mem.TokenRows(4 * SEQ)
    parts = [torch.randn(2, SEQ, 16, generator=g) for _ in range(2)]
    for i, p in enumerate(parts):
        rows.add(p, torch.full((2, SEQ), i))
    assert torch.equal(rows.rows, torch.cat([p.reshape(-1, 16) for p in parts]))
    assert torch.equal(rows.token_ids(), torch.arange(2).repeat_interleave(2 * SEQ))
    moe = calibrate_moe.routed_moe(layer)
    expert, xe = next(iter(moe.experts.values())), torch.randn(9, m.cfg.hidden_size, generator=g)
    with torch.no_grad():
        assert torch.equal(calibrate_moe.down_input(moe, expert, xe), calibrate_moe._down_input_seen(expert, xe))
    a, b = torch.randn(6, 5, 7, generator=g), torch.randn(6, 5, 7, generator=g)
    assert mem.rel_error(a, b, 4) == pytest.approx(float((a - b).norm() / b.norm()), rel=1e-6)
