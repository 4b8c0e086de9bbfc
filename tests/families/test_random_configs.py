"""Every family on configs nobody chose: fresh seeds each run (kconvert/fixtures/random_configs draws a valid config
from each, valid by its reference's own rules), the checkpoint in the release's storage, converted at tp 1 without
quantization, its float32 log-probs against the reference's by verify's own path at mean KLD < 1e-5. The seeds are
printed (pytest -s, or in the failure), and a failure replays in one command with its config:

    python bench/random_configs.py --family dsv41 --seed 123

bench/random_configs.py sweeps hundreds per family (docs/BENCHMARKS.md). KCONVERT_RANDOM_CONFIGS=N runs N seeds a
family here (default 1: a few seconds each)."""

from __future__ import annotations

import os

import pytest

from helpers import one_thread
from kconvert.fixtures.random_configs import FAMILY_NAMES, draw
from kconvert.fixtures.random_configs.run import BOUND, run

SEEDS = int(os.environ.get("KCONVERT_RANDOM_CONFIGS", "1"))


def fresh_seed() -> int:
    return int.from_bytes(os.urandom(3), "little")


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_random_configs_match_the_reference(name, tmp_path):
    for _ in range(SEEDS):
        d = draw(name, fresh_seed())
        print(f"\n{name}: {d.replay}")
        with one_thread():
            r = run(d, tmp_path / str(d.seed))
        assert r.passed, f"{r.line()} (bound {BOUND})\n{d.describe()}"


def test_a_seed_names_one_config():
    """A seed replays: the same (family, seed) draws the same config and prompts, another seed another config."""
    a, b, c = draw("dsv41", 7), draw("dsv41", 7), draw("dsv41", 8)
    assert (a.config, a.prompts) == (b.config, b.prompts) and a.config != c.config


def test_a_config_the_reference_refuses_is_drawn_again():
    """Validity is the reference's word: draws it refuses are redrawn, each refusal kept with its reason."""
    from kconvert.fixtures.random_configs import Refused, family

    refused = next(d for s in range(200) if (d := draw("dsv41", s)).refused)
    assert refused.refused and all(isinstance(r, str) and r for r in refused.refused)
    family("dsv41").check(refused.config)  # what is returned passes the check
    with pytest.raises(Refused):
        family("dsv41").check({**refused.config, "text_config": {**refused.config["text_config"],
                                                                "kv_source_layer_ids": [0],
                                                                "compress_ratios": [0] * 8}})
