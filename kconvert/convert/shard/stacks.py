"""Shard a unit's small same-shape weights as stacks: a layer's routed experts (384 x gate/up/down in
Kimi-K2.5) are read, dequantized, sliced and quantized N at a time, then each expert's slices are written
to their ranks' files at their planned offsets. At 100k+ small tensors the ~25 torch calls and the
reads each tensor cost one at a time were nearly all of shard's time (issue 25); a stack pays them once.

A stack holds one unit's weights of one shape, stored form and output layout (the same slices, the same
transforms on every rank), at most STACK_BYTES of float32; a weight of more than shard_plan.STACK_ELEMS values is
done alone as before (its data, not the calls, sets the pace). Every result is bit-identical to the
one-at-a-time path (quant/stacked.py). A stack that fails a check raises NotStackable or the source's
CheckpointError: shard_unit then writes the whole unit one weight at a time, which names the bad
tensor exactly as it always has.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter, itemgetter
from typing import TYPE_CHECKING

from kconvert.convert.shard.outputs import Output
from kconvert.io import dtypes
from kconvert.io.safetensors_write import SafetensorsWriter
from kconvert.source.checkpoint import Checkpoint
from kconvert.source.logical_by_name import stack_columns

if TYPE_CHECKING:  # torch and the stacked readers and quantizers are imported where a stack is made: a job of plain
    import torch  # copies imports this module and never torch (convert/shard/byte_copy.py)

STACK_BYTES = 64 << 20  # float32 bytes of one stack at most (a real model's large experts are not stacked)

Pairs = Sequence[tuple[SafetensorsWriter, Output]]  # one source weight's outputs: the file and what goes in it


def plan_jobs(ck: Checkpoint, order: list[str], by_src: dict[str, Pairs], codes: dict | None) -> list[str | list[str]]:
    """The unit's source weights as jobs, in the order of each job's first weight: a weight alone (its name), or
    a stack (a list) of the weights that share a key, at most STACK_BYTES of float32; a stack of one too (a weight
    cut for every rank is still made in one call: _even_split)."""
    table = list(map(by_src.__getitem__, order))
    if list(map(len, table)).count(1) == len(table):  # each weight to one file (experts placed whole): its output's
        keys = list(map(_STACK_PART, map(_OUTPUT, map(_FIRST, table))))
    else:
        keys = [tuple(map(_STACK_PART, map(_OUTPUT, pairs))) for pairs in table]
    stackable = {key: _stackable(key, pairs) for key, pairs in dict(zip(keys, table)).items()}  # once per key
    jobs: list[str | list[str]] = []
    open_stack: dict = {}
    most: dict = {}  # key -> weights a stack of it holds at most
    for src, key in zip(order, keys):
        if not stackable[key] or (codes and src in codes):
            jobs.append(src)  # alone
            continue
        stack = open_stack.get(key)
        if stack is None:
            most[key] = max(1, -(-STACK_BYTES // (ck.logical[src].numel * 4)))
        if stack is None or len(stack) >= most[key]:
            stack = open_stack[key] = []
            jobs.append(stack)
        stack.append(src)
    return jobs


def _stackable(key, pairs: Pairs) -> bool:
    """Whether weights of this key (every output's stack_part, or the one output's: the plan's id of the source's
    stored form, the cut, the storage; None: never stacked) go as stacks: every output stackable, and stored in a
    way quant/stacked.py does."""
    from kconvert.quant import stacked

    return None not in (key if isinstance(key, tuple) else (key,)) and all(
        stacked.supports_copy(o.copy.transform, o.options) if o.copy is not None else
        o.scheme is None or stacked.supports(o.scheme, o.options) for _, o in pairs)


def write_stack(ck: Checkpoint, srcs: list[str], by_src: dict[str, Pairs]) -> int:
    """Read, transform and write the stack `srcs` (weights sharing a plan_jobs key); returns the source
    bytes done (for progress)."""
    import torch

    from kconvert.quant import stacked
    from kconvert.source.stacked import read_fp4_parts, read_stack

    pairs0, n = by_src[srcs[0]], len(srcs)
    t0, parts = stack_columns(ck.logical, srcs)  # their stored entries by role, no LogicalTensor each
    copies = pairs0[0][1].copy is not None  # whole FP4 experts copied (or re-encoded exactly): their stored parts
    x = read_fp4_parts(t0, parts) if copies else read_stack(t0, parts, ck.int4_group())
    made: dict = {} if copies else _even_split(x, [o for _, o in pairs0])  # a replicated output is made once, too
    rows_of: dict = {}  # made key -> a byte row a weight, per planned tensor
    crcs_of: dict = {}  # made key -> the rows' CRC-32s (a replicated output's: passed over once, not once per rank)
    table = list(map(by_src.__getitem__, srcs))
    for j, (_, o0) in enumerate(pairs0):
        p = o0.piece
        key = (o0.transform, o0.options) if p.dim is None else j
        rows = rows_of.get(key)
        if rows is None:
            stacks = made.get(key)
            if stacks is None and copies:
                stacks = stacked.copy_parts(o0.copy.transform, x, o0.options)
            elif stacks is None:
                stacks = _produce(o0, x if p.dim is None else x.narrow(p.dim + 1, p.start, p.stop - p.start))
            specs0 = o0.specs()
            if [(dtypes.TAGS.get(s.dtype), tuple(s.shape[1:])) for s in stacks] != [(tag, tuple(shape)) for _, tag, shape in specs0]:
                raise RuntimeError(f"stacked {o0.transform} of {o0.src} does not match its planned {specs0}")
            rows = rows_of[key] = [s.view(torch.uint8).numpy().reshape(n, -1) for s in stacks]
        tail = o0.specs()[0][0][len(o0.src):]  # a weight's first stored tensor: its name + this (`_packed` for FP4)
        if n == 1:  # a weight alone: its file takes its tensors in one write
            writer = pairs0[j][0]
            first = writer.index(o0.src + tail)
            _check_planned(writer, [first], o0)
            crcs_of[key] = writer.write_bytes(first, [r[0] for r in rows], crcs_of.get(key))  # (n is the call's)
            continue
        pairs = list(map(itemgetter(j), table))
        # every output of the stack planned alike (then its specs are o0's, names aside), each file's at once
        hows = set(map(_HOW, map(_OUTPUT, pairs)))  # (usually one: a bucket's expert group on this rank)
        if hows != {o0.how} and set(map(_SHAPE_TRANSFORM, hows)) != {_SHAPE_TRANSFORM(o0.how)}:
            raise RuntimeError(f"{srcs}: not every weight is planned as a stacked {o0.transform} of {o0.shape}")
        writers = list(map(_WRITER, pairs))
        if writers.count(writers[0]) == n:  # one file takes them all (the usual under tp)
            by_writer = {writers[0]: range(n)}
        else:  # experts spread over the ranks (ep)
            by_writer = {}
            for i, writer in enumerate(writers):
                by_writer.setdefault(writer, []).append(i)
        for writer, ns in by_writer.items():
            mine = srcs if len(ns) == n else [srcs[i] for i in ns]
            firsts = writer.indices([name + tail for name in mine] if tail else mine)
            _check_planned(writer, firsts, o0)
            if len(ns) == n:  # (experts spread over the ranks: each file's rows differ, their CRCs too)
                crcs_of[key] = writer.write_stacked(firsts, rows, crcs_of.get(key))
            else:
                writer.write_stacked(firsts, [r[ns] for r in rows])
    return n * sum(o.bytes_in for _, o in pairs0)  # every weight's outputs alike (checked)


def _check_planned(writer: SafetensorsWriter, firsts: list[int], o0: Output) -> None:
    """The file planned each of these outputs' first tensor as o0's (the sizes of every tensor: the writer)."""
    specs0 = o0.specs()
    if set(map(_TAG_SHAPE, map(writer.specs.__getitem__, firsts))) != {(specs0[0][1], specs0[0][2])}:
        raise RuntimeError(f"{writer.path}: {o0.src} is not planned as a stacked {o0.transform}")


_WRITER, _OUTPUT = itemgetter(0), itemgetter(1)  # of a (writer, output) pair
_FIRST = itemgetter(0)  # a weight's first (writer, output) pair
_STACK_PART = attrgetter("how.stack_part")
_HOW, _SHAPE_TRANSFORM = attrgetter("how"), attrgetter("shape", "transform")
_TAG_SHAPE = itemgetter(1, 2)  # of a planned (name, tag, shape)


def _even_split(x: torch.Tensor, outs: list[Output]) -> dict[int, list[torch.Tensor]]:
    """Rank j's produced stack for every j, when the weights are cut into equal pieces stored alike (tensor
    parallelism's usual cut): made in one call over the [N * k, ...] pieces, each still its own weight (its own
    scales: the same bits), then split; one call, not k. {} otherwise."""
    k, o0 = len(outs), outs[0]
    d = o0.piece.dim
    if k < 2 or d is None or x.shape[d + 1] % k:
        return {}
    size = x.shape[d + 1] // k
    for j, o in enumerate(outs):
        if o.piece.dim != d or o.piece.start != j * size or o.piece.stop != (j + 1) * size or \
                o.transform != o0.transform or o.shape != o0.shape:
            return {}
    n = x.shape[0]
    pieces = x.unflatten(d + 1, (k, size)).movedim(d + 1, 1).reshape(n * k, *o0.shape)  # [N * k, piece]
    return dict(enumerate(zip(*(s.unflatten(0, (n, k)).unbind(1) for s in _produce(o0, pieces)))))


def _produce(o: Output, x: torch.Tensor) -> list[torch.Tensor]:
    """shard_unit._produce over a stack: contiguous [N, ...] tensors, one per planned spec."""
    import torch

    from kconvert.quant import stacked

    if o.scheme is not None:
        return stacked.quantize(o.scheme, x, o.options)
    return [(x.to(torch.bfloat16) if o.transform == "bf16" else x).contiguous()]
