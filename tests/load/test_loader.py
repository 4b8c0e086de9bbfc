"""kconvert.load.loader and `kconvert load`: every fixture conversion loads exactly, prefetch is ordered and
bounded, device selection, and the bad inputs of issue 4 (one line, exit 2, nothing half-loaded)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import assert_one_line_error, run_cli, rewrite_catalog
from kconvert.load import views as views_mod
from kconvert.errors import LoaderError
from kconvert.load.loader import open_converted


@pytest.fixture(scope="module")
def conversions(conversion):
    """(quant, tp) -> converted dir of tiny-k25-dsv32 (fp8 from the block-FP8 source: the lossless path)."""
    return {(quant, tp): conversion("tiny-k25-dsv32-fp8" if quant == "fp8" else "tiny-k25-dsv32", tp=tp, quant=quant)
            for quant in ("none", "fp8", "int8") for tp in (1, 2)}


@pytest.mark.parametrize("quant", ["none", "fp8", "int8"])
@pytest.mark.parametrize("tp", [1, 2])
def test_every_tensor_equals_the_file(conversions, quant, tp):
    out = conversions[quant, tp]
    for rank in range(tp):
        conv = open_converted(out, rank=rank, world_size=tp)
        seen = []
        for unit, tensors in conv.stream("cpu", prefetch=2, verify=True):
            seen.append(unit)
            want = load_file(conv.file_of(unit))
            assert set(tensors) == set(want), unit
            for name, t in tensors.items():
                assert t.dtype == want[name].dtype and t.shape == want[name].shape, name
                assert torch.equal(t.view(torch.uint8) if t.dtype.itemsize == 1 else t,
                                   want[name].view(torch.uint8) if t.dtype.itemsize == 1 else want[name]), name
        assert seen == conv.units and seen[0] == "globals" and seen[1] == "vision"
        assert seen[2:] == sorted(seen[2:])
        if quant == "fp8":
            assert any(t.dtype == torch.float8_e4m3fn for t in tensors.values())


def test_cpu_tensors_share_one_buffer_per_file(conversions):
    conv = open_converted(conversions["none", 1])
    tensors = conv.load_unit("layer-0001")
    ptrs = {t.untyped_storage().data_ptr() for t in tensors.values()}
    assert len(ptrs) == 1  # views of the file buffer: no second copy


def test_prefetch_is_bounded_and_in_order(conversions, monkeypatch):
    conv = open_converted(conversions["none", 2], rank=0)
    fetched: list[str] = []
    real = conv._fetch

    def spy(unit, *a, **k):
        fetched.append(unit)
        return real(unit, *a, **k)

    monkeypatch.setattr(conv, "_fetch", spy)
    consumed = 0
    for unit, _ in conv.stream("cpu", prefetch=1):
        consumed += 1
        time.sleep(0.05)  # a slow consumer: the reader must not run ahead unboundedly
        # at most: the one consumed + one waiting in the window + one being read
        assert len(fetched) - consumed <= 2, (fetched, consumed)
    assert fetched == conv.units


def test_device_selection(conversions):
    out = conversions["none", 1]
    r = run_cli("load", out, "--device", "cpu", "--json", check=True)
    rep = json.loads(r.stdout)
    assert rep["device"] == "cpu" and rep["files"] == len(open_converted(out).units)
    auto = json.loads(run_cli("load", out, "--json", check=True).stdout)
    expect = "cpu" if not torch.cuda.is_available() else "cuda:0"
    assert auto["device"] == expect
    if not torch.cuda.is_available():
        assert_one_line_error(run_cli("load", out, "--device", "cuda:0"), "cuda:0", "not available")
    assert_one_line_error(run_cli("load", out, "--device", "musa:3"), "musa:3")
    assert_one_line_error(run_cli("load", out, "--device", "tpu-ish"), "tpu-ish")


# ------------------------------------------------------------------ bad input


def _copy(conversions, tmp_path, key=("none", 2)) -> Path:
    import shutil

    dst = tmp_path / "conv"
    shutil.copytree(conversions[key], dst)
    return dst


def test_missing_shard(conversions, tmp_path):
    out = _copy(conversions, tmp_path)
    (out / "rank-001" / "layer-0001.safetensors").unlink()
    assert_one_line_error(run_cli("load", out, "--rank", "1"), "rank-001/layer-0001.safetensors", "missing")


def test_truncated_shard(conversions, tmp_path):
    out = _copy(conversions, tmp_path)
    f = out / "rank-000" / "layer-0002.safetensors"
    f.write_bytes(f.read_bytes()[:-64])
    assert_one_line_error(run_cli("load", out), "layer-0002.safetensors", "truncated")


def test_flipped_byte_is_reported_before_use(conversions, tmp_path):
    out = _copy(conversions, tmp_path)
    f = out / "rank-000" / "layer-0001.safetensors"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    assert_one_line_error(run_cli("load", out, "--verify"), "layer-0001.safetensors", "checksum")
    conv = open_converted(out)
    got = []
    with pytest.raises(LoaderError):
        for unit, _ in conv.stream("cpu", verify=True):
            got.append(unit)
    assert "layer-0001" not in got and got == ["globals", "vision", "layer-0000"]


def test_other_format_version(conversions, tmp_path):
    out = _copy(conversions, tmp_path)
    meta = json.loads((out / "kconvert.json").read_text())
    meta["format_version"] = 99
    rewrite_catalog(out, meta)
    assert_one_line_error(run_cli("load", out), "kconvert.json", "format version 99")


def test_rank_out_of_range_and_world_size_mismatch(conversions):
    out = conversions["none", 2]
    assert_one_line_error(run_cli("load", out, "--rank", "2"), "rank 2", "tp 2")
    assert_one_line_error(run_cli("load", out, "--world-size", "4"), "tp 2", "world size is 4")


def test_tensor_missing_from_a_layer(conversions, tmp_path):
    from safetensors.torch import save_file

    out = _copy(conversions, tmp_path)
    rel = "rank-000/layer-0001.safetensors"
    tensors = load_file(out / rel)
    victim = next(n for n in sorted(tensors) if "kv_b_proj" in n)
    del tensors[victim]
    save_file(tensors, out / rel)
    meta = json.loads((out / "kconvert.json").read_text())
    meta["files"][rel]["bytes"] = (out / rel).stat().st_size  # a consistent-looking but incomplete shard
    rewrite_catalog(out, meta)
    assert_one_line_error(run_cli("load", out), rel, victim, "missing")


def test_load_with_engine_warmup(conversions):
    rep = json.loads(run_cli("load", conversions["fp8", 1], "--warmup", "2", "--json", check=True).stdout)
    s = rep["seconds"]
    assert s["warmup"] > 0 and abs(s["ready"] - (s["start_ranks"] + s["open"] + s["load"] + s["warmup"])) < 1e-6
    # without --rank a tp-2 conversion starts both ranks (tests/engine/test_launch.py); with one, it cannot warm up alone
    assert_one_line_error(run_cli("load", conversions["none", 2], "--warmup", "1", "--rank", "1"), "drop --rank")


@pytest.mark.parametrize("seed", range(4))
def test_strided_views_equal_one_view_per_tensor(seed, monkeypatch):
    """tensor_views makes evenly spaced tensors of one dtype and shape as one strided view split in C: every tensor is
    what a slice + dtype view + reshape of its own bytes gives (values, shape, contiguity, no copy), on layouts
    drawn at random: interleaved roles, odd-sized tensors that leave others misaligned (copied), empty tensors,
    and a buffer that starts off a dtype's boundary (a staging slice)."""
    import random

    from kconvert.io.header_entries import TensorEntry
    from kconvert.io.safetensors_read import SafetensorsHeader

    rng = random.Random(seed)
    kinds = [("F32", (3, 4)), ("BF16", (2, 8)), ("U8", (8,)), ("F32", (1, 1)), ("I64", ()), ("BF16", (0, 4)),
             ("U8", (3,))]
    entries, at = {}, 0
    layout = [i % 3 for i in range(30)]  # stretches of a repeating (F32, BF16, U8) triple (a layer's roles), odd
    for _ in range(rng.randrange(3, 7)):  # tensors between them
        layout += [i % 3 for i in range(3 * rng.randrange(0, 16))] + [rng.randrange(len(kinds)) for _ in range(3)]
    for i, k in enumerate(layout):
        tag, shape = kinds[k]
        size = {"F32": 4, "BF16": 2, "U8": 1, "I64": 8}[tag] * int(torch.tensor(shape).prod().item() if shape else 1)
        entries[f"t{i}"] = TensorEntry(f"t{i}", Path("x"), tag, shape, at, at + size)
        at += size
    lead = rng.choice([0, 0, 1, 2])  # the buffer as a slice of a larger one, `lead` bytes in
    store = torch.randint(0, 256, (lead + at + 8,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    buf = store[lead:lead + at]
    one_by_one = []
    monkeypatch.setattr(views_mod, "_view", lambda b, e, view=views_mod._view: one_by_one.append(e) or view(b, e))
    views = views_mod.tensor_views(SafetensorsHeader(Path("x"), at, 0, entries, {}), buf)
    monkeypatch.undo()
    assert len(one_by_one) <= len(entries) - 10  # the first stretch strided (U8s at least, whatever the lead)
    assert list(views) == list(entries)
    for name, e in entries.items():
        want = views_mod._view(buf, e)
        got = views[name]
        assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous(), name
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), name
        if e.nbytes and not (lead + e.begin) % want.element_size():
            assert got.data_ptr() == store.data_ptr() + lead + e.begin, name  # a view, not a copy


def test_without_populate_advice_pages_are_read_one_by_one(conversions, monkeypatch):
    """A kernel without cachestat, mincore or MADV_POPULATE_READ: each page is read ahead instead, the same tensors."""
    from kconvert.io import pages

    out = conversions["none", 2]
    want = {u: {k: v.clone() for k, v in t.items()} for u, t in open_converted(out, rank=1).stream("cpu")}
    for fn in ("_MADVISE", "_MINCORE", "_SYSCALL"):
        monkeypatch.setattr(pages, fn, None)
    for verify in (False, True):
        got = dict(open_converted(out, rank=1).stream("cpu", verify=verify))
        assert list(got) == list(want)
        for unit, tensors in got.items():
            assert all(torch.equal(tensors[k].view(torch.uint8), want[unit][k].view(torch.uint8)) for k in tensors)


@pytest.mark.parametrize("verify", [False, True])
def test_a_shard_cut_short_while_mapped_is_an_error_not_a_crash(conversions, tmp_path, monkeypatch, verify):
    """A file that shrinks between its size check and its mapping (pages past its end: SIGBUS to a reader that
    touches them) is refused in one line naming the file, before any of its tensors is handed out."""
    from kconvert.load import loader

    out = _copy(conversions, tmp_path)
    f = out / "rank-001" / "layer-0001.safetensors"
    real = loader.file_cached

    def cut_then_ask(fd, size):  # (called with the file mapped, before any page is read)
        with open(f, "r+b") as fh:
            fh.truncate(4096)
        return real(fd, size)

    monkeypatch.setattr(loader, "file_cached", cut_then_ask)
    conv = open_converted(out, rank=1)
    got = []
    with pytest.raises(LoaderError, match="cannot read the shard") as e:
        for unit, _ in conv.stream("cpu", units=["layer-0001"], verify=verify):
            got.append(unit)
    assert got == [] and e.value.file.endswith("layer-0001.safetensors")


def test_crc_in_pieces_passes_clean_files_and_names_a_flipped_byte(conversions, tmp_path, monkeypatch):
    """verify computes a file's CRC-32 in pieces on the reader's threads and combines them: a clean file passes, and
    one flipped byte in any piece fails before its unit is handed out."""
    from kconvert.load import loader

    monkeypatch.setattr(loader, "CRC_CHUNK", 4096)  # tiny files: many pieces each
    assert [u for u, _ in open_converted(conversions["none", 2], rank=1).stream("cpu", verify=True)]
    out = _copy(conversions, tmp_path)
    f = out / "rank-001" / "layer-0002.safetensors"
    data = bytearray(f.read_bytes())
    assert len(data) > 3 * 4096
    data[len(data) - 4096 - 7] ^= 0x20  # in a middle piece, not the first or the last
    f.write_bytes(bytes(data))
    got = []
    with pytest.raises(LoaderError, match="checksum"):
        for unit, _ in open_converted(out, rank=1).stream("cpu", verify=True):
            got.append(unit)
    assert "layer-0002" not in got
