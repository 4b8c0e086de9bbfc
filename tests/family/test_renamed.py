"""Renamed fixture presets and bundled example configs keep working for one release under their old names,
and say what they are called now (kconvert/renamed.py)."""

from __future__ import annotations

import json

from helpers import cli_here

from kconvert import renamed
from kconvert.fixtures import PRESETS
from kconvert.family.manifest import manifests_dir


def test_every_old_name_points_at_something_current():
    assert set(renamed.PRESETS.values()) <= set(PRESETS)
    assert not set(renamed.PRESETS) & set(PRESETS)  # no old name is still a preset of its own
    for new in renamed.EXAMPLES.values():
        assert (manifests_dir() / "examples" / new / "config.json").is_file()
    # `k3` names are left for the real Kimi K3: no current preset or example claims one for another model
    assert not [n for n in PRESETS if "k3" in n and not n.startswith(("tiny-kimi-k3", "topo-kimi-k3", "release-kimi-k3"))]


def test_an_old_preset_name_builds_the_new_preset_and_says_so(tmp_path, checkpoint):
    p = cli_here("fixture", "tiny-k3", tmp_path / "old")
    assert p.returncode == 0, p.stderr
    assert "'tiny-k3' is now called 'tiny-k25-dsv32'" in p.stderr
    new = checkpoint("tiny-k25-dsv32")
    assert sorted(f.name for f in (tmp_path / "old").iterdir()) == sorted(f.name for f in new.iterdir())
    for f in new.iterdir():  # same preset, same seed: the same bytes
        assert (tmp_path / "old" / f.name).read_bytes() == f.read_bytes(), f.name


def test_an_old_example_name_plans_the_new_example_and_says_so():
    old = cli_here("plan", "kimi-k3-3t", "--tp", "8", "--quant", "fp8", "--json")
    new = cli_here("plan", "k25-dsv32-3t", "--tp", "8", "--quant", "fp8", "--json")
    assert old.returncode == new.returncode == 0, old.stderr
    assert "'kimi-k3-3t' is now called 'k25-dsv32-3t'" in old.stderr and not new.stderr
    assert json.loads(old.stdout) == json.loads(new.stdout)
