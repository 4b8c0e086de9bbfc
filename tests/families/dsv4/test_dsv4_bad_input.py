"""Damaged DeepSeek-V4 checkpoints through the CLI: one line naming the file and tensor, exit 2, nothing
written. (Damaged data, an e8m0 scale of 0xFF or a tid2eid entry out of range: tests/families/dsv4/test_dsv4_formats.py
where it is read, tests/families/dsv4/test_dsv4_shard.py through shard.)"""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file, save_file

from helpers import assert_one_line_error, cli_here


def rewrite(src, drop: str | None = None, add: dict[str, torch.Tensor] | None = None) -> str:
    """Drop one tensor from (or add some to) the shard that holds `drop` (or the first shard)."""
    index_path = src / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    fname = index["weight_map"][drop] if drop else sorted(set(index["weight_map"].values()))[0]
    tensors = load_file(src / fname)
    if drop:
        del tensors[drop], index["weight_map"][drop]
    for name, t in (add or {}).items():
        tensors[name] = t
        index["weight_map"][name] = fname
    save_file(tensors, src / fname, metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))
    return fname


def test_missing_hc_head_is_named(checkpoint, copy_checkpoint, tmp_path):
    src = copy_checkpoint(checkpoint("tiny-dsv4"))
    rewrite(src, drop="hc_head_fn")
    assert_one_line_error(cli_here("inspect", src), "tensor hc_head_fn", "required by the deepseek_v4 manifest")
    out = tmp_path / "out"
    assert_one_line_error(cli_here("shard", src, out, "--tp", "1"), "tensor hc_head_fn")
    assert not out.exists()


def test_unknown_tensor_is_an_error_not_a_drop(checkpoint, copy_checkpoint, tmp_path):
    src = copy_checkpoint(checkpoint("tiny-dsv4"))
    fname = rewrite(src, add={"layers.0.attn.wq_c.weight": torch.zeros(4, 4, dtype=torch.bfloat16)})
    assert_one_line_error(cli_here("inspect", src), fname, "tensor layers.0.attn.wq_c.weight",
                          "not known to the deepseek_v4 manifest")


def test_wrong_shape_is_named(checkpoint, copy_checkpoint):
    src = copy_checkpoint(checkpoint("tiny-dsv4"))
    rewrite(src, drop="layers.2.attn.compressor.ape")
    rewrite(src, add={"layers.2.attn.compressor.ape": torch.zeros(4, 64)})  # HCA's rate is 8 here
    assert_one_line_error(cli_here("inspect", src), "tensor layers.2.attn.compressor.ape", "implies [8, 64]")
