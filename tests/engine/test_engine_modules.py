"""The engine as an nn.Module tree: its state_dict keys are the converted checkpoint's tensor names, every
linear is the class of the format kconvert.json records for it, a unit with a missing or an extra tensor is
one typed error naming it, and layer kinds come from engine/models/registry.py. (Its numerics are tested against
transformers in test_engine_logits.py.)"""

from __future__ import annotations

import pytest
import torch

from engine.models import registry as layers
from engine.layers.linear import BY_TRANSFORM, PlainLinear, StoredLinear
from engine.model import Model
from kconvert.convert.stages import StageSplit
from kconvert.distributed import Group
from kconvert.errors import CheckpointError, EngineError
from kconvert.load.loader import open_converted


@pytest.fixture(scope="module")
def conv(conversion):
    return lambda quant: conversion("tiny-k25-dsv32", tp=1, quant=quant)


@pytest.mark.parametrize("quant", ["fp8", "int4"])
def test_state_dict_is_the_catalog_and_each_linear_its_stored_format(conv, quant):
    out = conv(quant)
    model = Model.from_converted(out, dtype=torch.float32)
    records = {t["name"]: t for t in open_converted(out).catalog.tensors}
    state = model.state_dict()
    head = f"{model.prefix}lm_head.weight"
    assert set(state) - {head} == set(records) - {head}  # a head tied to the embeddings is stored once
    assert all(list(state[n].shape) == records[n]["shape"] for n in records)  # held as stored
    for path, m in model.named_modules():
        if isinstance(m, StoredLinear) and path != head.removesuffix(".weight"):
            stored = records.get(f"{path}.weight") or records[f"{path}.weight_packed"]
            assert type(m) is BY_TRANSFORM[stored["transform"]], path
    model.materialize()
    assert {type(m) for m in model.modules() if isinstance(m, StoredLinear)} == {PlainLinear}


def test_a_missing_or_extra_tensor_is_one_error_naming_it(conv):
    out = conv("fp8")
    model, c = Model.empty(out, Group(), "cpu", torch.float32)
    unit = "layer-0001"
    tensors = c.load_unit(unit)
    scale = f"{model.prefix}model.layers.1.self_attn.o_proj.weight_scale_inv"
    with pytest.raises(CheckpointError) as e:
        model.take_unit(unit, {k: v for k, v in tensors.items() if k != scale})
    assert e.value.tensor == scale and "missing" in e.value.one_line()
    stray = f"{model.prefix}model.layers.1.self_attn.q_c_proj.weight"
    with pytest.raises(CheckpointError) as e:
        model.take_unit(unit, {**tensors, stray: torch.zeros(2, 2)})
    assert e.value.tensor == stray and "does not use" in e.value.one_line()


def test_mtp_layers_are_on_the_last_stage_as_the_converter_places_them(conv):
    c = open_converted(conv("none"))
    n = c.config["text_config"]["num_hidden_layers"]
    model = Model(c.config, c.family, Group(rank=0, world=2, tp=1, pp=2), stages=[[0], list(range(1, n))])
    split = StageSplit(((0, 1), (1, n)), (1, 1))
    for L in range(n + 2):  # n, n + 1: MTP layers
        assert model.stage_of_layer(L) == split.stage_of_layer(L)


def test_an_unknown_layer_kind_is_named():
    with pytest.raises(EngineError, match="no attention kind 'v4_csa'"):
        layers.kind(layers.ATTENTION, "v4_csa", "attention")
