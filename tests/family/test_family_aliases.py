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


def test_a_names_ending_decides_before_any_regex_search():
    """ModelMap.aliased skips the regex for a name that cannot end as every rule's plain-text end before `$` does
    (Kimi K3's `..._weight$`); it answers as a search of every name would, on names drawn around each family's
    rules, and a rule whose end is no plain text (a class, a group, an escape such as \\d, an alternation outside
    a group, a case-blind flag) keeps the search for every name."""
    import random

    from kconvert.family.families import family_aliases, literal_ends

    assert literal_ends(family_aliases({"aliases": {r"^a\.(b|c)_weight$": "x", r"^d\.e$": "y"}})) == \
        ("_weight", "_weight\n", "d.e", "d.e\n")
    for odd in (r"^a\d$", r"^a[bc]$", r"^a(b|c)$", r"^a|b$", r"(?i)^ab$", r"^a\.b", r"^a\$", r"^a+$"):
        assert literal_ends(family_aliases({"aliases": {odd: "x", r"^d\.e$": "y"}})) is None, odd
    import json

    from kconvert.family.families import manifests_dir
    from kconvert.family.manifest import bind

    rng = random.Random(5)
    words = ["language_model", "model", "layers", "7", "mlp_res", "self_attention_res", "norm_weight", "proj_weight",
             "weight", "blocks", "attn", "norm", "mm_projector", "_weight", "x"]
    seen = set()
    for config in sorted((manifests_dir() / "examples").glob("*/config.json")):
        model = bind(json.loads(config.read_text()))
        if not model.aliases or model.name in seen:
            continue
        seen.add(model.name)
        for _ in range(300):
            names = [".".join(rng.choice(words) for _ in range(rng.randrange(1, 7))) + rng.choice(["", "\n", "_weight"])
                     for _ in range(rng.randrange(1, 6))]
            assert model.aliased(names) == any(p.search(n) for p, _ in model.aliases for n in names), (model.name, names)
        for name in ("language_model.model.layers.7.mlp_res.norm_weight", "language_model.model.output_attn_res.proj_weight\n",
                     "language_model.model.blocks.3.x", "model.mm_projector.proj.0.weight", "layers.2.attn.norm.weight"):
            assert model.aliased([name]) == any(p.search(name) for p, _ in model.aliases), (model.name, name)
    assert {"kimi_k3", "kimi_k25"} <= seen
    assert bind(json.loads((manifests_dir() / "examples" / "kimi-k3" / "config.json").read_text()))._alias_ends
