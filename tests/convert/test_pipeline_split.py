"""The pipeline split itself (issue 15), pure: the balanced partition against brute force, heavy first
and last stages, --pp-layers and its errors. The conversions it drives: test_pipeline_convert.py."""

from __future__ import annotations

import itertools
import random

import pytest

from kconvert.convert.stages import parse_pp_layers, partition, split_layers, stage_bytes
from kconvert.errors import UsageError


def brute_force(layer_bytes, pp, first, last) -> int:
    """The least possible largest stage, over every contiguous split (independent of the DP)."""
    n, best = len(layer_bytes), None
    for cuts in itertools.combinations(range(1, n), pp - 1):
        ranges = list(zip((0,) + cuts, cuts + (n,)))
        worst = max(max(sum(layer_bytes[L][r] for L in range(a, b)) + (first[r] if s == 0 else 0)
                        + (last[r] if s == pp - 1 else 0) for r in range(len(first)))
                    for s, (a, b) in enumerate(ranges))
        best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_partition_is_the_least_largest_stage_and_contiguous(seed):
    rng = random.Random(seed)
    tp, n = rng.choice([1, 2, 3]), rng.randint(2, 9)
    layer_bytes = [[rng.randint(1, 100) for _ in range(tp)] for _ in range(n)]
    first, last = [rng.randint(0, 150) for _ in range(tp)], [rng.randint(0, 150) for _ in range(tp)]
    for pp in range(1, n + 1):
        s = partition(layer_bytes, pp, first, last)
        assert s.pp == pp and s.layers[0][0] == 0 and s.layers[-1][1] == n
        assert all(a < b for a, b in s.layers) and all(s.layers[i][1] == s.layers[i + 1][0] for i in range(pp - 1))
        assert max(s.bytes) == brute_force(layer_bytes, pp, first, last)
        assert s.bytes == stage_bytes(layer_bytes, s.layers, first, last)


def test_heavy_edges_push_layers_off_their_stage():
    # 9 equal layers; the first stage also holds a 3-layer-sized embedding + vision: it gets 3 layers, not 4 or 5
    s = partition([[10]] * 9, 2, first=[30], last=[0])
    assert s.layers == ((0, 3), (3, 9)) and s.bytes == (60, 60) and s.imbalance == 0
    # a heavy rank decides: stage bytes are the largest rank's
    s = partition([[10, 1]] * 4, 2, first=[0, 25], last=[0, 0])
    assert s.layers == ((0, 2), (2, 4)) and s.bytes == (27, 20)
    # among the splits with the least largest stage, the smallest stage is as large as it can be
    s = partition([[1], [1], [1], [1], [1], [6]], 3)
    assert max(s.bytes) == 6 and min(s.bytes) == 2, s


@pytest.mark.parametrize("text, needle", [
    ("0-1,2-3", "names 2 stages but --pp is 3"),
    ("0-1,3-4,5-5", "layer 2 is in no stage"),
    ("0-2,2-4,5-5", "layer 2 is already in stage 0"),
    ("0-1,2-3,4-4", "layer 5 is in no stage"),
    ("0-1,2-3,4-6", "the model has 6 decoder layers (0-5)"),
    ("0-1,3-2,4-5", "stage 1 (3-2) is empty"),
    ("0-1,x,4-5", "'x' is not a layer range"),
])
def test_pp_layers_errors_are_one_line_and_say_why(text, needle):
    with pytest.raises(UsageError) as e:
        parse_pp_layers(text, 6, 3)
    assert needle in e.value.message and "\n" not in e.value.message
    assert parse_pp_layers("0-1,2,3-5", 6, 3) == ((0, 2), (2, 3), (3, 6))


def test_pp_beyond_the_layer_count_is_refused():
    with pytest.raises(UsageError, match="3 decoder layers and every stage needs at least one"):
        partition([[1]] * 3, 4)
    assert split_layers([[1]] * 3, 3, override="0,1,2").layers == ((0, 1), (1, 2), (2, 3))
