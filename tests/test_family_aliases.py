"""A Kimi checkpoint written by transformers' `save_pretrained` (llm-compressor's outputs are) stores 155 of
tiny-k25-dsv32's 189 tensors under transformers' save-side names (`language_model.model.blocks.N`,
`model.mm_projector`, `vision_tower.encoder.patch_embed`): kimi_k25's [family.aliases] read them as the
published names, the same family, every tensor the same values."""

from __future__ import annotations

import warnings

import torch

from helpers import cli_here
from kconvert.source.checkpoint import Checkpoint


def test_transformers_save_pretrained_names_read_as_the_family(checkpoint, tmp_path):
    import transformers

    src = checkpoint("tiny-k25-dsv32")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.Kimi_K25ForConditionalGeneration.from_pretrained(str(src), dtype=torch.bfloat16)
    model.save_pretrained(str(tmp_path / "saved"))
    saved, ours = Checkpoint.open(tmp_path / "saved"), Checkpoint.open(src)
    renamed = [e.name for e in saved.stored.values() if ".blocks." in e.name or "mm_projector" in e.name]
    assert len(renamed) > 100  # on disk: transformers' names
    assert saved.family == "kimi_k25" and saved.logical.keys() == ours.logical.keys()
    saved.validate()
    for name in ours.logical:
        assert torch.equal(saved.read(name), ours.read(name)), name
    r = cli_here("inspect", tmp_path / "saved", "--json")
    assert r.returncode == 0, r.stderr
