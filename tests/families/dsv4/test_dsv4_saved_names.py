"""A DeepSeek-V4 fine-tune re-saved by transformers' `save_pretrained` (5.23) does not store the released names:
its load-time renaming runs backwards behind the `model.` prefix it adds, so `embed.weight`, `hc_head_fn` and
`norm.weight` come out as `model.embed_tokens.weight`, `model.hc_head.hc_fn`, `model.norm.weight`, every layer
as `model.layers.N.*`, and the attention's `attn.kv_norm` as `attn.norm` (transformers also drops the MTP block
and keeps norms in float32). The deepseek_v4 manifest's [family.aliases] read them as released: the same tensors,
and a conversion that matches transformers running its own saved checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from helpers import assert_one_line_error, cli_here, one_thread
from kconvert.source.checkpoint import Checkpoint

CSA, HCA, SLIDING = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
# not a preset: three layers in another order, three mHC streams, one hash-routed layer
CONFIG = {"num_hidden_layers": 3, "layer_types": [HCA, CSA, SLIDING], "mlp_layer_types": ["hash_moe", "moe", "moe"],
          "hc_mult": 3}
# transformers' save-side spelling -> the released name, as seen in the saved file (every other name: "model." + it)
SAVED_AS = {"model.embed_tokens.weight": "embed.weight", "model.hc_head.hc_fn": "hc_head_fn",
            "model.hc_head.hc_base": "hc_head_base", "model.hc_head.hc_scale": "hc_head_scale",
            "model.layers.0.attn.norm.weight": "layers.0.attn.kv_norm.weight", "head.weight": "head.weight"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(released-layout checkpoint, what transformers saves after loading it: the user's fine-tune path)."""
    from transformers import DeepseekV4ForCausalLM

    from kconvert.fixtures.models.dsv4 import build_v4_model, write_v4_model
    from kconvert.fixtures.tokenizers.kimi import write_kimi_tokenizer

    root = tmp_path_factory.mktemp("v4saved")
    released, out = root / "released", root / "saved"
    released.mkdir()
    write_v4_model(build_v4_model(seed=5, overrides=CONFIG), released, seed=5)
    DeepseekV4ForCausalLM.from_pretrained(str(released), dtype="auto").save_pretrained(str(out))
    write_kimi_tokenizer(out)  # a user saves the tokenizer beside it; transformers' model class writes none
    return released, out


def stored_names(root) -> dict[str, str]:
    names = {}
    for f in root.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            names.update({k: str(h.get_slice(k).get_dtype()) for k in h.keys()})
    return names


def test_saved_names_read_as_released(saved):
    released, out = saved
    on_disk = stored_names(out)
    assert SAVED_AS.keys() <= on_disk.keys()  # transformers still writes these spellings (else: revisit the aliases)
    assert not any(n.startswith(("layers.", "embed.", "mtp.")) or ".kv_norm." in n for n in on_disk)
    assert on_disk["model.layers.0.attn.norm.weight"] == "F32"  # kept in float32 by transformers; released: BF16
    ck, ref = Checkpoint.open(out), Checkpoint.open(released)
    assert ck.family == "deepseek_v4"
    ck.validate()
    assert ck.logical.keys() == {n for n in ref.logical if not n.startswith("mtp.")}  # transformers drops MTP
    for name in ck.logical:  # each spelling bound to its own tensor: the values the released layout holds
        assert torch.equal(ck.read(name).float(), ref.read(name).float()), name
    r = cli_here("inspect", out, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["family"] == "deepseek_v4"


@pytest.fixture(scope="module")
def reference(saved, tmp_path_factory):
    """transformers running its own saved checkpoint (the aliases play no part in what it loads)."""
    ref = tmp_path_factory.mktemp("v4savedref") / "ref.safetensors"
    r = cli_here("reference", saved[1], "--out", ref)
    assert r.returncode == 0, r.stderr
    return ref


@pytest.mark.parametrize("tp", [1, 2])
def test_saved_checkpoint_converts_losslessly(saved, reference, tmp_path, tp):
    out = tmp_path / f"tp{tp}"
    r = cli_here("shard", saved[1], out, "--tp", tp)
    assert r.returncode == 0, r.stderr
    with one_thread():
        r = cli_here("verify", out, "--reference", reference, "--json")
    rep = json.loads(r.stdout)
    assert r.returncode == 0 and rep["verdict"] == "PASS", r.stderr
    overall = rep["faithfulness"]["overall"]
    assert overall["mean_kld"] < 1e-6 and overall["same_top1_pct"] == 100.0, overall


def test_one_tensor_under_both_spellings_is_refused(saved, copy_checkpoint, tmp_path):
    src = copy_checkpoint(saved[1])
    path = src / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.1.attn.kv_norm.weight"] = tensors["model.layers.1.attn.norm.weight"].clone()
    save_file(tensors, path, metadata={"format": "pt"})
    for args in (("inspect", src), ("shard", src, tmp_path / "out", "--tp", 1)):
        r = cli_here(*args)
        assert_one_line_error(r, "stored under two spellings of layers.1.attn.kv_norm.weight", str(path),
                              "model.layers.1.attn.kv_norm.weight", "model.layers.1.attn.norm.weight")
    assert not (tmp_path / "out").exists()
