"""FP4 experts read as stacks (Kimi K3's MXFP4 U8 pairs + e8m0, DeepSeek-V4's int8 pairs + .scale), dequantized
(--quant none / int8), copied (fp4) or re-encoded exactly (fp8) a stack at a time: each weight's bytes exactly as the
one-at-a-time path makes them; a damaged scale, or a block one FP8 scale cannot hold, named exactly as before."""

from __future__ import annotations

import hashlib

import pytest

from kconvert.convert.shard import plan as shard_plan, unit as shard_unit
from helpers import shard_job
from kconvert.convert.shard.job import shard
from kconvert.errors import KConvertError
from kconvert.io.safetensors_read import read_header


def _digest(folder) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*.safetensors"))}


@pytest.mark.parametrize("preset,quant,tp", [("topo-kimi-k3", "none", 8), ("topo-kimi-k3", "int8", 2),
                                            ("topo-kimi-k3", "fp4", 8), ("topo-kimi-k3", "fp8", 2),
                                            ("topo-dsv4-pro", "none", 2), ("topo-dsv4-pro", "fp4", 2),
                                            ("topo-dsv4-pro", "fp8", 1)])
def test_fp4_experts_are_read_as_stacks_with_the_same_bytes(checkpoint, tmp_path, monkeypatch, preset, quant, tp):
    """Kimi K3's MXFP4 experts (U8 pairs + e8m0) and DeepSeek-V4's FP4 ones (int8 pairs + .scale), decoded a stack
    at a time by the one FP4 decoder: every output byte as the one-at-a-time path writes it. (K3's fp4 is a byte copy
    by default, convert/shard/byte_copy.py; the tensor path, what a compressed or remote source takes, is held here.)"""
    import kconvert.convert.shard.job as job

    monkeypatch.setattr(job, "plain_copies", lambda ck, items: False)
    src = checkpoint(preset, layers=3, experts=8)
    stacks = []
    real = shard_unit.write_stack
    monkeypatch.setattr(shard_unit, "write_stack", lambda ck, srcs, by_src: stacks.extend(srcs) or real(ck, srcs, by_src))
    shard(shard_job(src, tmp_path / "stacked", tp=tp, quant=quant))
    assert sum(".experts." in name for name in stacks) >= 2 * 3 * 8
    monkeypatch.setattr(shard_plan, "STACK_ELEMS", 0)
    shard(shard_job(src, tmp_path / "alone", tp=tp, quant=quant))
    stacked_files = _digest(tmp_path / "stacked")
    assert len(stacked_files) > 4 and stacked_files == _digest(tmp_path / "alone")


def _edit_scale(src, suffix: str, edit) -> None:
    """Rewrite the first byte of the e8m0 scales stored under `suffix` in place: edit(old byte) -> new byte."""
    files = [f for f in sorted(src.glob("*.safetensors")) if any(k.endswith(suffix) for k in read_header(f).tensors)]
    entry = next(e for k, e in read_header(files[0]).tensors.items() if k.endswith(suffix))
    with open(files[0], "r+b") as fh:
        fh.seek(entry.begin)
        old = fh.read(1)[0]
        fh.seek(entry.begin)
        fh.write(bytes([edit(old)]))


def _errors_stacked_and_alone(src, tmp_path, monkeypatch, quant: str) -> tuple[list[str], list[str]]:
    """The one-line errors of shard with stacks and with every weight alone, and the weights tried in a stack."""
    errors, stacked_names = [], []
    real = shard_unit.write_stack
    monkeypatch.setattr(shard_unit, "write_stack",
                        lambda ck, srcs, by_src: stacked_names.extend(srcs) or real(ck, srcs, by_src))
    for tag, elems in (("stacked", shard_plan.STACK_ELEMS), ("alone", 0)):
        monkeypatch.setattr(shard_plan, "STACK_ELEMS", elems)
        with pytest.raises(KConvertError) as e:
            shard(shard_job(src, tmp_path / tag, tp=2, quant=quant))
        errors.append(e.value.one_line())
    return errors, stacked_names


@pytest.mark.parametrize("byte", [0xFF, 0xFD])  # e8m0 NaN; 2^126, under which code 6 overflows float32
def test_a_damaged_fp4_scale_in_a_stack_is_named_as_before(checkpoint, copy_checkpoint, tmp_path, monkeypatch, byte):
    src = copy_checkpoint(checkpoint("topo-kimi-k3", layers=3, experts=8))
    _edit_scale(src, "layers.2.block_sparse_moe.experts.5.w3.weight_scale", lambda old: byte)
    errors, stacked_names = _errors_stacked_and_alone(src, tmp_path, monkeypatch, "none")
    assert any(".experts.5.w3" in n for n in stacked_names)  # the damaged expert was read in a stack first
    assert errors[0] == errors[1] and "experts.5.w3" in errors[0], errors


def test_a_block_fp8_cannot_hold_in_a_stack_is_refused_as_before(checkpoint, copy_checkpoint, tmp_path, monkeypatch):
    """One expert's group scales made to span 20 octaves inside one 128 x 128 block: the stack cannot re-encode it
    exactly, and the one-by-one path refuses it naming the tensor and suggesting --requantize, as before stacks."""
    src = copy_checkpoint(checkpoint("topo-kimi-k3", layers=3, experts=8))
    # its first group 2^20 times smaller than its neighbours
    _edit_scale(src, "layers.2.block_sparse_moe.experts.4.w1.weight_scale", lambda old: old - 20)
    errors, stacked_names = _errors_stacked_and_alone(src, tmp_path, monkeypatch, "fp8")
    assert any(".experts.4.w1" in n for n in stacked_names)  # tried in a stack first
    assert errors[0] == errors[1] and "experts.4.w1" in errors[0] and "--requantize" in errors[0], errors
