"""What shard's stacks (convert/shard/stacks.py, quant/stacked.py) share with code that must not import torch (the
plan, a job of plain copies: convert/shard/byte_copy.py): the lossless copies made over a stack, and the exception a
stack raises to be redone weight by weight."""

from __future__ import annotations

STACKED_COPIES = ("fp4_copy", "fp4_to_fp8")  # whole-tensor copies quant/stacked.copy_parts makes over a stack


class NotStackable(Exception):
    """A stack with a non-finite value: the caller redoes it weight by weight, which names the bad one."""
