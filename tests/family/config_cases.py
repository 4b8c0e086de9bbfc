"""Configs and engine runs shared by the config-validation tests (tests/family/test_limits_generated.py,
test_engine_after_bind.py): the tiny presets' config.json without their weights, the released configs of
manifests/examples, and the engine's whole reading of a config (every module it builds, no tensor loaded)."""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from types import SimpleNamespace

EXAMPLES = Path(__file__).resolve().parents[2] / "manifests" / "examples"


@functools.lru_cache(maxsize=None)
def _tiny() -> dict[str, dict]:
    from transformers import DeepseekV4Config

    from kconvert.fixtures.models.dsv4 import config_json as v4_json
    from kconvert.fixtures.models.dsv4_dspark import DSPARK
    from kconvert.fixtures.models.dsv41 import v41_config
    from kconvert.fixtures.models.hf_build import MODEL_SPECS, make_config
    from kconvert.fixtures.models.k25_dsv32 import config_json as k25_json
    from kconvert.fixtures.models.kimi_k3 import k3_config, kimi_linear_config
    from kconvert.fixtures.presets import TINY_DSV4

    v4 = v4_json(SimpleNamespace(config=DeepseekV4Config(**TINY_DSV4)), None)  # the preset's config, no weights built
    return {"tiny-dsv41": v41_config(), "tiny-kimi-k3": k3_config(), "tiny-kimi-linear": kimi_linear_config(),
            "tiny-k25-dsv32": k25_json(make_config(MODEL_SPECS["tiny-k25-dsv32"]), None),
            "tiny-dsv32-mtp": {**k25_json(make_config(MODEL_SPECS["tiny-dsv32"]), None), "num_nextn_predict_layers": 1},
            "tiny-dsv4": v4, "tiny-dsv4-dspark": {**v4, **DSPARK}}


def tiny_configs() -> dict[str, dict]:
    """{preset: its config.json} (fresh copies: callers mutate them)."""
    return copy.deepcopy(_tiny())


def example_configs() -> dict[str, dict]:
    """{name: config.json} of the releases in manifests/examples, and V4-Flash in the 0731 layout (a DSpark drafter)."""
    out = {p.parent.name: json.loads(p.read_text()) for p in sorted(EXAMPLES.glob("*/config.json"))}
    out["deepseek-v4-flash-0731"] = {**out["deepseek-v4-flash"], "dspark_target_layer_ids": [40, 41, 42],
                                     "dspark_block_size": 5, "dspark_noise_token_id": 128799, "dspark_markov_rank": 256}
    return out


def engine_build(config: dict, config_file: str = "config.json"):
    """Everything the engine builds from `config` before it reads a tensor: the model (its config reading, the stack),
    every decoder layer and draft stage the config counts, the vision tower and projector, a DSpark drafter's block
    settings and taps. Returns the model."""
    from engine.draft.dspark import DSparkDrafter
    from engine.draft.registry import DRAFTERS, draft_head
    from engine.model import Model
    from engine.models.registry import decoder_layer, vision_modules
    from kconvert.family.manifest import bind

    names = bind(config, config_file=config_file)
    n, extra = names.text.layer_count, names.text.extra_layers  # the draft stages the config counts, all converted
    model = Model(config, names.name, stages=[list(range(n + extra))], config_file=config_file)
    for L in range(n):
        decoder_layer(model.cfg, L, model.par)
    for L in model.draft_layers:
        draft_head(model.cfg, L, model.par, model.names)
    if model.mc.vision is not None:
        vision_modules(model.mc.vision)
    if model.draft_layers and DRAFTERS.get(model.cfg.draft_kind) is DSparkDrafter:
        DSparkDrafter.block_settings(model.cfg)
        DSparkDrafter.tap_layers(model)
    return model


class Recorded(dict):
    """A config (sections nested) that records every key read through it, as `section.key` paths."""

    def __init__(self, d: dict, path: str = "", log: set | None = None):
        self._path, self._log = path, set() if log is None else log
        super().__init__({k: Recorded(v, f"{path}{k}.", self._log) if isinstance(v, dict) else v for k, v in d.items()})

    @property
    def log(self) -> set:
        return self._log

    def __getitem__(self, key):
        self._log.add(self._path + str(key))
        return super().__getitem__(key)

    def get(self, key, default=None):
        self._log.add(self._path + str(key))
        return super().get(key, default)

    def __contains__(self, key):
        self._log.add(self._path + str(key))
        return super().__contains__(key)
