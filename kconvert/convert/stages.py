"""Pipeline stages: which contiguous decoder layers each of P stages holds (`shard --pp`, `plan --pp`).

The split is balanced by bytes per rank, not by layer count: a stage's devices must hold what its
largest rank holds, and layers weigh differently (dense first layers, MoE layers), as do the edges:
the first stage also holds the embeddings and the vision tower, the last the final norm and the head
(and the draft heads: MTP layers, with the embeddings too where they share the target's). Inputs are the bytes per tp rank of every unit after
quantization, from the shard plan (`shard`) or from the headers (`plan`), so both choose the same split.

`partition` minimises the largest stage (exact, by dynamic programming over contiguous splits) and,
among the splits that reach that minimum, maximises the smallest stage, so no stage is left light.
Pure functions: no I/O."""

from __future__ import annotations

import re
from dataclasses import dataclass

from kconvert.errors import UsageError

FIRST, LAST = "first", "last"


def edges_of(component: str, tied_without_head: bool = False, draft_embed: bool = False) -> tuple[str, ...]:
    """The edge stage(s) a tensor that belongs to no decoder layer goes to: the vision tower and projector
    and the embeddings on the first stage; the final norm and the head on the last, and the embeddings
    there too when the head is tied to them (the checkpoint has no lm_head of its own) or the draft heads
    (on the last stage) read the target's embeddings (`draft_embed`)."""
    if component in ("vision", "projector"):
        return (FIRST,)
    if component == "embed":
        return (FIRST, LAST) if tied_without_head or draft_embed else (FIRST,)
    return (LAST,)


@dataclass(frozen=True)
class StageSplit:
    """layers[s] = (start, stop): stage s holds decoder layers start..stop-1. bytes[s]: the bytes its
    largest rank holds (edges included)."""

    layers: tuple[tuple[int, int], ...]
    bytes: tuple[int, ...]

    @property
    def pp(self) -> int:
        return len(self.layers)

    @property
    def imbalance(self) -> float:
        """Largest stage over smallest, minus 1 (0.04: the heaviest stage holds 4 % more per rank)."""
        return max(self.bytes) / max(min(self.bytes), 1) - 1

    def stage_of_layer(self, layer: int) -> int:
        """The stage of a decoder layer; layers past the last (MTP) are on the last stage."""
        return next((s for s, (a, b) in enumerate(self.layers) if a <= layer < b), self.pp - 1)

    @property
    def spec(self) -> str:
        """The --pp-layers text of this split: '0-14,15-30,...'."""
        return ",".join(f"{a}-{b - 1}" for a, b in self.layers)


def parse_pp_layers(text: str, n_layers: int, pp: int) -> tuple[tuple[int, int], ...]:
    """'0-14,15-30,31-60' -> ((0, 15), (15, 31), (31, 61)); a bare 'N' is the one layer N. Refused, in
    one line: a malformed range, a count other than --pp, an empty, overlapping or out-of-order stage,
    a gap, or layers past the model's (it has n_layers decoder layers; MTP layers are not named)."""
    parts = [p.strip() for p in str(text).split(",")]
    out: list[tuple[int, int]] = []
    for p in parts:
        m = re.fullmatch(r"([0-9]{1,9})(?:\s*-\s*([0-9]{1,9}))?", p, re.ASCII)  # ASCII, and no 5000-digit int()
        if not m:
            raise UsageError(f"--pp-layers {text!r}: {p!r} is not a layer range like 0-14")
        a, b = int(m.group(1)), int(m.group(2) if m.group(2) is not None else m.group(1))
        if b < a:
            raise UsageError(f"--pp-layers {text!r}: stage {len(out)} ({p}) is empty: its last layer is before its first")
        out.append((a, b + 1))
    if len(out) != pp:
        raise UsageError(f"--pp-layers {text!r} names {len(out)} stages but --pp is {pp}")
    expect = 0
    for s, (a, b) in enumerate(out):
        if a != expect:
            why = f"layer {expect} is in no stage" if a > expect else f"layer {a} is already in stage {s - 1}"
            raise UsageError(f"--pp-layers {text!r}: stages must be contiguous and in order: {why}")
        expect = b
    if expect != n_layers:
        missing = f"layer {expect} is" if expect == n_layers - 1 else f"layers {expect}-{n_layers - 1} are"
        why = f"{missing} in no stage" if expect < n_layers else \
            f"the model has {n_layers} decoder layers (0-{n_layers - 1})"
        raise UsageError(f"--pp-layers {text!r}: {why}")
    return tuple(out)


def check_pp(pp: int, n_layers: int) -> None:
    if pp < 1:
        raise UsageError(f"--pp {pp} must be at least 1")
    if pp > n_layers:
        raise UsageError(f"--pp {pp}: the model has {n_layers} decoder layers and every stage needs at least one")


def _columns(layer_bytes, first, last) -> list[tuple[list[int], int, int]]:
    """Per distinct tp rank: (bytes by layer, first-edge bytes, last-edge bytes). Ranks with the same
    bytes everywhere (the usual case: whole experts, even vocab slices) are one column."""
    tp = max([len(r) for r in layer_bytes] + [len(first or ()), len(last or ()), 1])
    cols = {(tuple(row[r] for row in layer_bytes), (first or [0] * tp)[r], (last or [0] * tp)[r]) for r in range(tp)}
    return [(list(c[0]), c[1], c[2]) for c in cols]


def stage_bytes(layer_bytes: list[list[int]], ranges, first: list[int] | None = None,
                last: list[int] | None = None) -> tuple[int, ...]:
    """Bytes of the largest rank of every stage of `ranges`."""
    cols, n = _columns(layer_bytes, first, last), len(ranges)
    return tuple(max(sum(c[a:b]) + (f if s == 0 else 0) + (z if s == n - 1 else 0) for c, f, z in cols)
                 for s, (a, b) in enumerate(ranges))


def partition(layer_bytes: list[list[int]], pp: int, first: list[int] | None = None,
              last: list[int] | None = None) -> StageSplit:
    """Split decoder layers 0..L-1 (layer_bytes[L][r]: bytes of layer L on tp rank r) into `pp` contiguous,
    non-empty stages minimising the largest stage's largest rank; `first` / `last` (bytes per tp rank)
    are added to the first / last stage."""
    n = len(layer_bytes)
    check_pp(pp, n)
    if pp == 1:  # one stage holds every layer (what plan's search tries first for every tp degree)
        return StageSplit(((0, n),), stage_bytes(layer_bytes, ((0, n),), first, last))
    cols = _columns(layer_bytes, first, last)
    pre = [[0] * (n + 1) for _ in cols]
    for k, (c, _, _) in enumerate(cols):
        for i, b in enumerate(c):
            pre[k][i + 1] = pre[k][i] + b
    seg = [[0] * (n + 1) for _ in range(n + 1)]  # seg[i][j]: layers i..j-1 as one stage (edges where they touch)
    for i in range(n):  # a row at a time, each column's sums as one list (61 layers: 1,891 stages per split)
        rows = [[b - p[i] + (f if i == 0 else 0) for b in p[i + 1:]] for p, (_, f, _) in zip(pre, cols)]
        for row, (_, _, z) in zip(rows, cols):
            row[-1] += z  # the last layer's stage holds the last edge
        seg[i][i + 1:] = rows[0] if len(rows) == 1 else list(map(max, *rows))
    worst = _least_largest(seg, n, pp)
    choice = _most_smallest(seg, n, pp, worst)
    bounds, j = [], n
    for k in range(pp, 0, -1):
        i = choice[k][j]
        bounds.append((i, j))
        j = i
    ranges = tuple(reversed(bounds))
    return StageSplit(ranges, tuple(seg[a][b] for a, b in ranges))


def _least_largest(seg, n, pp) -> int:
    """min over splits of layers 0..n-1 into pp stages of the largest stage (dp[k][j]: layers 0..j-1 in k
    stages). seg[i][j] grows as i falls, so the scan over the last stage's start stops once it is no better."""
    inf = float("inf")
    dp = [0] + [inf] * n
    for k in range(1, pp + 1):
        nxt = [inf] * (n + 1)
        for j in range(k, n - (pp - k) + 1):
            best = inf
            for i in range(j - 1, k - 2, -1):
                if seg[i][j] >= best:
                    break
                v = max(dp[i], seg[i][j])
                if v < best:
                    best = v
            nxt[j] = best
        dp = nxt
    return dp[n]


def _most_smallest(seg, n, pp, cap):
    """Among splits whose every stage is <= cap, one that maximises the smallest stage: choice[k][j] is the
    start of stage k when layers 0..j-1 form k stages."""
    dp = [float("inf")] + [-1] * n
    choice = [[0] * (n + 1) for _ in range(pp + 1)]
    for k in range(1, pp + 1):
        nxt = [-1] * (n + 1)
        for j in range(k, n - (pp - k) + 1):
            best, arg = -1, k - 1
            for i in range(j - 1, k - 2, -1):
                if seg[i][j] > cap:
                    break
                v = min(dp[i], seg[i][j]) if dp[i] != -1 else -1
                if v > best:
                    best, arg = v, i
            nxt[j], choice[k][j] = best, arg
        dp = nxt
    return choice


def split_layers(layer_bytes: list[list[int]], pp: int, first: list[int] | None = None,
                 last: list[int] | None = None, override: str | None = None) -> StageSplit:
    """The balanced split, or the one --pp-layers names (validated), with the bytes of each stage."""
    if override is None:
        return partition(layer_bytes, pp, first, last)
    check_pp(pp, len(layer_bytes))
    ranges = parse_pp_layers(override, len(layer_bytes), pp)
    return StageSplit(ranges, stage_bytes(layer_bytes, ranges, first, last))
