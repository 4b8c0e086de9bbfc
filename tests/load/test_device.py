"""The accelerator path on the stand-in device (kconvert/testing/standin.py): the loader's device branch
(pinned staging ring, side-stream copies, events, one allocation per unit), `kconvert load --device
standin [--warmup]` and the engine, each against the CPU path, byte for byte."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import ROOT, assert_one_line_error
from kconvert.convert.pack import pack
from helpers import shard_job
from kconvert.convert.shard.job import shard
from kconvert import devices
from kconvert.testing import standin
from kconvert.load.loader import open_converted

DEV = standin.install()  # once per process; off except while this module's tests run
standin.enable(False)


@pytest.fixture(autouse=True)
def standin_on():
    standin.enable(True)
    standin.configure(copy_delay=0.0)
    standin.reset_stats()
    yield
    standin.enable(False)  # other test modules asking for "auto" must still get cpu


@pytest.fixture(scope="module")
def converted(checkpoint, conversion, tmp_path_factory):
    """name -> converted dir: fp8 tp1 (lossless from block-FP8), int8 tp2, none tp1 packed (zstd)."""
    base = tmp_path_factory.mktemp("device")
    out = {"fp8": conversion("tiny-k25-dsv32-fp8", tp=1, quant="fp8"),
           "int8-tp2": conversion("tiny-k25-dsv32", tp=2, quant="int8"),
           "packed": shard(shard_job(checkpoint("tiny-k25-dsv32"), base / "packed", tp=1, quant="none")).out}  # packed in place: its own
    pack(out["packed"])
    return {k: Path(v) for k, v in out.items()}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.cpu() if t.device.type != "cpu" else t
    return t.contiguous().view(-1).view(torch.uint8) if t.numel() else t.view(torch.uint8)


@pytest.mark.parametrize("name,rank", [("fp8", 0), ("int8-tp2", 1), ("packed", 0)])
def test_device_stream_equals_cpu_bytes(converted, name, rank):
    standin.configure(copy_delay=0.005)  # copies really are late: a missing wait shows as wrong bytes
    cpu = dict(open_converted(converted[name], rank=rank).stream("cpu"))
    conv = open_converted(converted[name], rank=rank)
    seen = []
    for unit, tensors in conv.stream(DEV, prefetch=2, verify=True):
        seen.append(unit)
        assert set(tensors) == set(cpu[unit]), unit
        storages = {standin.raw(t).untyped_storage().data_ptr() for t in tensors.values()}
        assert len(storages) == 1, unit  # one device allocation per unit, tensors are views of it
        for n, t in tensors.items():
            assert t.device == DEV and t.dtype == cpu[unit][n].dtype and t.shape == cpu[unit][n].shape, n
            assert torch.equal(_bytes(t), _bytes(cpu[unit][n])), (unit, n)
    assert seen == conv.units
    s = standin.STATS
    assert s.violations == []
    assert s.copies_queued == len(conv.units)  # every unit crossed on a side stream
    assert s.pinned_allocations == 3 and len(s.copy_sources) <= 3  # prefetch + 1 pinned buffers, reused
    assert conv.stats.bytes == sum(h.size for h in _headers(conv))


def _headers(conv):
    from kconvert.io.safetensors_read import read_header

    return [read_header(conv.file_of(u)) for u in conv.units]


@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_prefetch_depth_is_honoured(converted, monkeypatch, prefetch):
    conv = open_converted(converted["int8-tp2"], rank=0)
    started: list[str] = []
    real = conv._fetch

    def spy(unit, *a, **k):
        started.append(unit)
        return real(unit, *a, **k)

    monkeypatch.setattr(conv, "_fetch", spy)
    ahead = []
    for i, (unit, _) in enumerate(conv.stream(DEV, prefetch=prefetch)):
        time.sleep(0.1)  # a slow consumer: the reader gets every chance to run ahead
        ahead.append(len(started) - (i + 1))
    assert started == conv.units
    assert max(ahead) == min(prefetch, len(conv.units) - 1), ahead  # reaches the depth, never beyond
    assert standin.STATS.pinned_allocations == min(prefetch + 1, len(conv.units))


def test_staging_waits_for_the_copy_in_flight(converted):
    """Copies slower than reads: the reader must block on the slot's event before refilling it, and
    the consumer gets each unit while its copy may still run (the host never waits for it)."""
    standin.configure(copy_delay=0.05)
    conv = open_converted(converted["fp8"])
    got, still_copying = {}, 0
    for unit, tensors in conv.stream(DEV, prefetch=1):
        still_copying += any(standin.in_flight(t) for t in tensors.values())
        got[unit] = tensors
    devices.synchronize(DEV)
    s = standin.STATS
    assert s.violations == []  # no source rewritten mid-copy, no memory read before its copy
    assert any(name.startswith("kconvert-staging") for name in s.blocked_waits), s.blocked_waits
    assert still_copying > 0
    cpu = dict(open_converted(converted["fp8"]).stream("cpu"))
    for unit, tensors in got.items():
        for n, t in tensors.items():
            assert torch.equal(_bytes(t), _bytes(cpu[unit][n])), (unit, n)


def test_the_standin_catches_what_a_gpu_would(converted):
    """The checks above can fail: rewriting a staging buffer mid-copy, or reading a destination
    before waiting on its copy's event, are recorded (and give wrong bytes)."""
    standin.configure(copy_delay=0.5)
    mod = torch.get_device_module(DEV.type)
    host = devices.pinned_empty(64)
    host.fill_(7)
    dst = torch.empty(64, dtype=torch.uint8, device=DEV)
    side = mod.Stream(DEV)
    with mod.stream(side):
        dst.copy_(host, non_blocking=True)
    early = dst.cpu()  # no wait on an event: garbage, as on a GPU
    host.fill_(9)  # the source rewritten while the copy is queued
    side.synchronize()
    assert not torch.equal(early, torch.full((64,), 7, dtype=torch.uint8))
    assert len(standin.STATS.violations) == 2, standin.STATS.violations
    with mod.stream(side):
        torch.empty(8, dtype=torch.uint8, device=DEV).copy_(torch.zeros(8, dtype=torch.uint8), non_blocking=True)
    side.synchronize()
    assert "unpinned" in standin.STATS.violations[-1]
    with pytest.raises(RuntimeError, match="same device"):
        dst + torch.ones(64, dtype=torch.uint8)


def test_consumer_stopping_early_leaves_nothing_in_flight(converted):
    standin.configure(copy_delay=0.02)
    conv = open_converted(converted["fp8"])
    stream = conv.stream(DEV, prefetch=2)
    unit, tensors = next(stream)
    stream.close()
    assert unit == "globals" and not any(standin.in_flight(t) for t in tensors.values())
    assert standin.STATS.violations == []


def test_damaged_shard_is_refused_before_any_of_it_reaches_the_device(converted, tmp_path):
    import shutil

    from kconvert.errors import LoaderError

    out = tmp_path / "conv"
    shutil.copytree(converted["fp8"], out)
    f = out / "rank-000" / "layer-0001.safetensors"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    got = []
    with pytest.raises(LoaderError, match="checksum"):
        for unit, _ in open_converted(out).stream(DEV, prefetch=2, verify=True):
            got.append(unit)
    assert got == ["globals", "vision", "layer-0000"] and standin.STATS.violations == []


@pytest.mark.parametrize("which", ["fp8", "kimi-k3"])
def test_engine_on_the_device_equals_cpu(converted, conversion, which):
    """tiny-k25-dsv32 (MLA + DSA, block FP8) and tiny-kimi-k3 (KDA states, MXFP4 experts kept FP4, the attention-
    residual stack): the same logits on the device as on the CPU, prefill and one decode step."""
    from engine.model import Model

    path = converted["fp8"] if which == "fp8" else conversion("tiny-kimi-k3", tp=1, quant="fp4")

    def logits(dev):
        conv = open_converted(path)
        model = Model(conv.config, conv.family, None, dev, torch.bfloat16)
        for unit, tensors in conv.stream(dev):
            model.take_unit(unit, tensors)
        model.check_complete()
        ids = torch.randint(0, model.cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(3))
        cache = model.new_cache(1, 16)
        first = model.forward(ids, cache)
        step = model.forward(first[:, -1:].argmax(-1), cache)  # one decode step through the KV cache
        assert first.device == dev and cache.latent_layers[0].latent.device == dev
        assert all(s.state.device == dev for s in getattr(cache, "states", []))  # KDA states on the device too
        return first.cpu(), step.cpu()

    cpu, dev = logits(torch.device("cpu")), logits(DEV)
    assert torch.equal(cpu[0], dev[0]) and torch.equal(cpu[1], dev[1])
    assert standin.STATS.violations == []


def _cli(*args) -> subprocess.CompletedProcess:
    """`kconvert ARGS` in a fresh process with the stand-in registered first (as torch_musa's import would)."""
    code = "import sys; from kconvert.testing import standin; standin.install(); from cli.main import main; sys.exit(main())"
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


def test_cli_load_with_warmup_on_the_device(converted):
    r = _cli("load", converted["fp8"], "--device", "standin", "--verify", "--warmup", "1", "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    conv = open_converted(converted["fp8"])
    assert rep["device"] == "standin:0" and rep["files"] == len(conv.units) and rep["verified"]
    assert rep["seconds"]["warmup"] > 0 and rep["peak_device_bytes"] >= conv.total_bytes
    assert_one_line_error(_cli("load", converted["fp8"], "--device", "standin:7"), "standin:7", "2 standin")


def test_device_module_is_found_like_any_other():
    mod = torch.get_device_module("standin")
    for name in ("is_available", "device_count", "synchronize", "Stream", "Event", "current_stream", "stream",
                 "memory_allocated", "max_memory_allocated", "reset_peak_memory_stats"):
        assert hasattr(mod, name), name
    assert torch.accelerator.current_accelerator().type == "standin"
    assert devices.resolve("auto") == DEV and "standin:1" in devices.available()
    assert devices.resolve("standin:1") == torch.device("standin", 1)
    standin.enable(False)
    assert devices.resolve("auto") == torch.device("cpu") and devices.available() == ["cpu"]


ACCELERATOR_NAMES = ("cuda", "musa")


def test_only_devices_py_names_an_accelerator():
    """Code (not comments, docstrings or help text) outside kconvert/devices.py never names cuda or
    musa: an identifier (torch.cuda) or a string that is a device type ("cuda", "musa:0")."""
    import io
    import re
    import tokenize

    literal = re.compile(r"^[rbfu]*['\"](%s)(:\d+)?['\"]$" % "|".join(ACCELERATOR_NAMES))
    bad = []
    for folder in ("kconvert", "engine", "cli", "bench", "tools"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == ROOT / "kconvert/devices.py" or path.parent == ROOT / "kconvert/verify/vllm_check" and \
                    path.name.startswith(("vllm_", "driver")):
                continue  # (the vLLM driver runs in vLLM's environment: it stubs vLLM's CUDA-only pieces there)
            for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
                if (tok.type == tokenize.NAME and tok.string in ACCELERATOR_NAMES) or \
                        (tok.type == tokenize.STRING and literal.match(tok.string)):
                    bad.append(f"{path.relative_to(ROOT)}:{tok.start[0]}: {tok.line.strip()}")
    assert bad == []
