"""Stacks of small same-shape weights (issue 25): each weight's bytes exactly as the one-at-a-time path makes
them, on fresh random inputs, and a damaged weight in a stack reported exactly as before."""

from __future__ import annotations

import hashlib

import pytest
import torch

from kconvert.convert.shard import plan as shard_plan, unit as shard_unit
from helpers import shard_job
from kconvert.convert.shard.job import shard
from kconvert.errors import KConvertError
from kconvert.io.safetensors_read import read_header, read_tensor
from kconvert.io.safetensors_write import SafetensorsWriter
from kconvert.io import stacked_read
from kconvert.io.stacked_read import read_stacked
from kconvert.quant import stacked
from kconvert.quant.fp8_block import quantize_fp8_block
from kconvert.quant.int8_channel import quantize_int8_channel
from kconvert.quant.packing import pack_int32_words
from kconvert.source.formats import dequant_int4_packed


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _weights(n: int, rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """Weights of very different magnitudes, a zero block and a zero row among them."""
    w = torch.randn(n, rows, cols, generator=gen) * torch.logspace(-4, 3, n)[:, None, None]
    w[0, :min(rows, 128), :min(cols, 128)] = 0
    w[-1, -1] = 0
    return w.to(torch.bfloat16)


@pytest.mark.parametrize("shape", [(7, 32, 64), (3, 130, 200), (5, 256, 384), (2, 1, 3)])
def test_stacked_quantizers_match_each_weight_alone(shape):
    gen = torch.Generator().manual_seed(sum(shape))
    w = _weights(*shape, gen)
    q, s = stacked.fp8_blocks(w)
    q8, s8 = stacked.int8_rows(w)
    for i in range(shape[0]):
        ref_q, ref_s = quantize_fp8_block(w[i])
        assert _same(q[i], ref_q) and _same(s[i], ref_s)
        ref_q8, ref_s8 = quantize_int8_channel(w[i])
        assert _same(q8[i], ref_q8) and _same(s8[i], ref_s8)


def test_a_non_finite_weight_makes_the_stack_unstackable():
    w = torch.randn(4, 16, 32)
    w[2, 3, 5] = float("nan")
    with pytest.raises(stacked.NotStackable):
        stacked.fp8_blocks(w)
    with pytest.raises(stacked.NotStackable):
        stacked.int8_rows(w)


@pytest.mark.parametrize("rows,cols,group", [(32, 64, 32), (16, 128, 64), (8, 60, 32), (8, 48, 32)])
def test_stacked_int4_dequantize_matches_each_weight_alone(rows, cols, group):
    """cols 60: a padded last word (and a short last group); 48 with group 32: the scale is repeated, not broadcast."""
    gen = torch.Generator().manual_seed(rows * cols + group)
    n, padded = 6, -(-cols // 8) * 8
    codes = torch.randint(-8, 8, (n, rows, padded), generator=gen, dtype=torch.int8)
    packed = torch.stack([pack_int32_words(c) for c in codes])
    scale = (torch.rand(n, rows, -(-cols // group), generator=gen) * 0.1).to(torch.bfloat16)
    got = stacked.dequantize_int4_words(packed, scale, cols, group)
    for i in range(n):
        assert _same(got[i], dequant_int4_packed(packed[i], scale[i], (rows, cols), group))


@pytest.mark.parametrize("gap,run_tensors", [(256 << 10, None), (0, 3), (40, 2)])
def test_read_stacked_matches_each_read(tmp_path, monkeypatch, gap, run_tensors):
    """Two files; equally spaced runs, uneven gaps, and an order that is not the files' order; runs cut by the
    gap they may read past and by the most one read takes."""
    monkeypatch.setattr(stacked_read, "GAP", gap)
    if run_tensors:
        monkeypatch.setattr(stacked_read, "RUN_BYTES", run_tensors * 48 + 20)
    gen = torch.Generator().manual_seed(3)
    entries = []
    for f in range(2):
        specs, tensors = [], []
        for i in range(9):
            tensors.append(torch.randn(4, 6, generator=gen).to(torch.bfloat16))
            specs.append((f"w{i}", "BF16", (4, 6)))
            if i % 4 == 3:  # something else between some of them
                tensors.append(torch.randn(1 + i, generator=gen))
                specs.append((f"x{i}", "F32", (1 + i,)))
        w = SafetensorsWriter(tmp_path / f"f{f}.safetensors", specs)
        for (name, _, _), t in zip(specs, tensors):
            w.write(name, t)
        w.commit()
        header = read_header(tmp_path / f"f{f}.safetensors")
        entries += [header.tensors[f"w{i}"] for i in range(9)]
    order = entries[::-1][:5] + entries[:13]
    got = read_stacked(order)
    assert got.shape == (len(order), 4, 6)
    for i, e in enumerate(order):
        assert _same(got[i], read_tensor(e))
    for e in order[:2]:  # a stack of one
        assert _same(read_stacked([e])[0], read_tensor(e))


def _digest(folder) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*.safetensors"))}


@pytest.mark.parametrize("quant,tp,ep", [("none", 2, None), ("fp8", 2, 1), ("int8", 4, 2), ("int4", 2, None)])
def test_stacked_shard_writes_the_same_bytes(checkpoint, tmp_path, monkeypatch, quant, tp, ep):
    """ep 1: each expert cut across the ranks (stacks of slices); int4 is not stacked (its clip search)."""
    src = checkpoint("topo-k25", layers=3, experts=8)
    stacks = []
    real = shard_unit.write_stack
    monkeypatch.setattr(shard_unit, "write_stack", lambda ck, srcs, by_src: stacks.extend(srcs) or real(ck, srcs, by_src))
    shard(shard_job(src, tmp_path / "stacked", tp=tp, ep=ep, quant=quant))
    experts = sum(".experts." in name for name in stacks)  # int4 quantizes experts alone (its clip search)
    assert experts == (0 if quant == "int4" else 2 * 3 * 8) and len(stacks) > experts
    monkeypatch.setattr(shard_plan, "STACK_ELEMS", 0)  # every weight alone: the path before stacks
    shard(shard_job(src, tmp_path / "alone", tp=tp, ep=ep, quant=quant))
    stacked_files = _digest(tmp_path / "stacked")
    assert len(stacked_files) > 4 and stacked_files == _digest(tmp_path / "alone")


@pytest.mark.parametrize("scale", [b"\xc0\x7f", b"\x7f\x7f"])  # a bf16 NaN; the largest bf16 (x 8 overflows)
def test_a_damaged_expert_in_a_stack_is_named_as_before(checkpoint, copy_checkpoint, tmp_path, monkeypatch, scale):
    src = copy_checkpoint(checkpoint("topo-k25", layers=3, experts=8))
    suffix = "layers.2.mlp.experts.5.up_proj.weight_scale"
    files = [f for f in sorted(src.glob("*.safetensors")) if any(k.endswith(suffix) for k in read_header(f).tensors)]
    entry = next(e for k, e in read_header(files[0]).tensors.items() if k.endswith(suffix))
    with open(files[0], "r+b") as fh:
        fh.seek(entry.begin + 2)
        fh.write(scale)  # the second scale of the first row
    errors, stacked = [], []
    real = shard_unit.write_stack
    monkeypatch.setattr(shard_unit, "write_stack", lambda ck, srcs, by_src: stacked.extend(srcs) or real(ck, srcs, by_src))
    for tag, elems in (("stacked", shard_plan.STACK_ELEMS), ("alone", 0)):
        monkeypatch.setattr(shard_plan, "STACK_ELEMS", elems)
        with pytest.raises(KConvertError) as e:
            shard(shard_job(src, tmp_path / tag, tp=2, quant="fp8"))
        errors.append(e.value.one_line())
    assert any(".experts.5.up_proj" in n for n in stacked)  # the damaged expert was read in a stack first
    assert errors[0] == errors[1] and "experts.5.up_proj" in errors[0]


@pytest.mark.parametrize("staged", [True, False])
def test_writer_takes_tensors_in_any_order(tmp_path, monkeypatch, staged):
    """The same file and CRCs whatever order the tensors come in; each planned tensor exactly once. Staged:
    a small file put together in memory; else each tensor written at its offset."""
    import zlib

    from kconvert.io import safetensors_write

    monkeypatch.setattr(safetensors_write, "STAGE_BYTES", 1 << 20 if staged else 0)

    gen = torch.Generator().manual_seed(5)
    tensors = {"a": torch.randn(3, 5, generator=gen), "b": torch.randn(7, generator=gen).to(torch.bfloat16),
               "c": torch.randint(-8, 8, (4, 4), generator=gen, dtype=torch.int8), "d": torch.zeros(0),
               "e": torch.randn(2, 2, generator=gen).to(torch.float8_e4m3fn)}
    specs = [(n, {torch.float32: "F32", torch.bfloat16: "BF16", torch.int8: "I8",
                  torch.float8_e4m3fn: "F8_E4M3"}[t.dtype], tuple(t.shape)) for n, t in tensors.items()]
    records = []
    for tag, order in (("in-order", "abcde"), ("shuffled", "ecadb")):
        w = SafetensorsWriter(tmp_path / f"{tag}.safetensors", specs)
        for n in order:
            if n == "b" and tag == "shuffled":  # b and c adjacent: one write of both
                w.write_bytes(w.index("b"), [t.view(torch.uint8).reshape(-1).numpy() for t in (tensors["b"], tensors["c"])])
            elif n != "c" or tag == "in-order":
                w.write(n, tensors[n])
        records.append(w.commit())
    a, b = ((tmp_path / f"{t}.safetensors").read_bytes() for t in ("in-order", "shuffled"))
    assert a == b and records[0].crc32 == records[1].crc32 == f"{zlib.crc32(a):08x}"
    assert records[0].tensor_crc32 == records[1].tensor_crc32 and list(records[1].tensor_crc32) == list("abcde")
    w = SafetensorsWriter(tmp_path / "twice.safetensors", specs)
    w.write("a", tensors["a"])
    with pytest.raises(RuntimeError, match="once"):
        w.write("a", tensors["a"])
    w = SafetensorsWriter(tmp_path / "short.safetensors", specs)
    w.write("e", tensors["e"])
    with pytest.raises(RuntimeError, match="never written"):
        w.finish()
    assert not list(tmp_path.glob(".*tmp*"))


def test_frozen_gc_unfreezes_what_it_froze_and_leaves_a_callers_freeze():
    import gc

    from kconvert.io.gc_pause import frozen_gc

    assert gc.get_freeze_count() == 0
    with frozen_gc() as freeze:
        frozen = gc.get_freeze_count()
        made = [[i] for i in range(1000)]
        freeze()
        assert frozen > 0 and gc.get_freeze_count() >= frozen + len(made)
    assert gc.get_freeze_count() == 0
    gc.freeze()
    try:
        before = gc.get_freeze_count()
        with frozen_gc() as freeze:
            freeze()
        assert gc.get_freeze_count() == before
    finally:
        gc.unfreeze()


def test_a_library_shard_keeps_nothing_alive_after_it_returns(checkpoint, tmp_path, monkeypatch):
    """Only a process that ends with os._exit (cli.main.entry) keeps a conversion's source and plan to the end;
    a library caller gets them freed when shard returns."""
    import weakref

    from kconvert.io import gc_pause
    from kconvert.source.checkpoint import Checkpoint

    opened = []
    real_open = Checkpoint.open.__func__
    monkeypatch.setattr(Checkpoint, "open", classmethod(lambda cls, *a, **k: opened.append(real_open(cls, *a, **k))
                                                        or opened[-1]))
    src = checkpoint("topo-k25", layers=2, experts=4)
    shard(shard_job(src, tmp_path / "lib", tp=2))
    ck = weakref.ref(opened.pop())
    assert gc_pause._kept is None and ck() is None
    monkeypatch.setattr(gc_pause, "_kept", None)
    gc_pause.end_without_teardown()
    shard(shard_job(src, tmp_path / "cli", tp=2))
    assert opened[-1] in gc_pause._kept


def test_a_failed_stack_read_is_redone_one_by_one_and_a_write_error_is_not(checkpoint, tmp_path, monkeypatch):
    """A source read error in a stack: the unit again, weight by weight (same bytes); a write error: raised."""
    from kconvert.errors import DiskFullError
    from kconvert.source import stacked as source_stacked

    src = checkpoint("topo-k25", layers=3, experts=8)
    shard(shard_job(src, tmp_path / "ref", tp=2, quant="fp8"))
    calls = []

    def flaky(entries):
        calls.append(len(entries))
        raise FileNotFoundError(2, "gone for a moment", str(entries[0].file))

    monkeypatch.setattr(source_stacked, "read_stacked", flaky)
    shard(shard_job(src, tmp_path / "redone", tp=2, quant="fp8"))
    assert calls and _digest(tmp_path / "redone") == _digest(tmp_path / "ref")
    monkeypatch.undo()
    opened = []  # each unit's files: opened again only by a redo
    real_open = shard_unit._open
    monkeypatch.setattr(shard_unit, "_open", lambda batch, out: opened.append(batch[0].unit) or real_open(batch, out))
    for method in ("write_bytes", "write_stacked"):  # lone weights and stacks
        monkeypatch.setattr(SafetensorsWriter, method, lambda *a: (_ for _ in ()).throw(DiskFullError("disk full")))
    with pytest.raises(DiskFullError):
        shard(shard_job(src, tmp_path / "full", tp=2, quant="fp8"))
    assert opened and len(opened) == len(set(opened))


@pytest.mark.parametrize("staged", [True, False])
def test_writer_takes_a_stack_of_outputs_as_one_at_a_time(tmp_path, monkeypatch, staged):
    """write_stacked: interleaved like outputs (gate/up of each expert: every 2nd equally spaced), a weight and its
    scale per output, and an order that is not the file's: the same file and CRCs as tensor by tensor."""
    import numpy as np

    from kconvert.io import safetensors_write

    monkeypatch.setattr(safetensors_write, "STAGE_BYTES", 1 << 20 if staged else 0)
    gen = torch.Generator().manual_seed(11)
    tensors, specs = {}, []
    for e in range(7):
        for name, shape in ((f"e{e}.gate", (3, 4)), (f"e{e}.gate_scale", (1,)), (f"e{e}.up", (3, 4)),
                            (f"e{e}.up_scale", (1,)), (f"e{e}.down", (5,))):
            tensors[name] = torch.randn(*shape, generator=gen)
            specs.append((name, "F32", shape))
    ref = SafetensorsWriter(tmp_path / "ref.safetensors", specs)
    for name, t in tensors.items():
        ref.write(name, t)
    want = ref.commit()

    def rows(names):
        return np.stack([tensors[n].view(torch.uint8).reshape(-1).numpy() for n in names])

    w = SafetensorsWriter(tmp_path / "stacked.safetensors", specs)
    pairs = [f"e{e}.{p}" for e in range(7) for p in ("gate", "up")]  # file order, two kinds alternating
    w.write_stacked([w.index(n) for n in pairs], [rows(pairs), rows([n + "_scale" for n in pairs])])
    downs = [f"e{e}.down" for e in (3, 0, 6, 1, 5, 2, 4)]  # not the file's order
    w.write_stacked([w.index(n) for n in downs], [rows(downs)])
    with pytest.raises(RuntimeError, match="once"):
        w.write_stacked([w.index("e0.down")], [rows(["e0.down"])])
    w = SafetensorsWriter(tmp_path / "stacked.safetensors", specs)
    w.write_stacked([w.index(n) for n in pairs], [rows(pairs), rows([n + "_scale" for n in pairs])])
    w.write_stacked([w.index(n) for n in downs], [rows(downs)])
    got = w.commit()
    assert (tmp_path / "stacked.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    assert (got.crc32, got.tensor_crc32) == (want.crc32, want.tensor_crc32)
