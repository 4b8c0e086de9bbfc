"""Draft heads (MTP layers): converted by default, each tensor once, on the last pipeline stage with the
embeddings they share; the engine's heads against independent references on configs that are no preset
(DeepSeek-V3.2-style MTP against one assembled from transformers' own DeepseekV32 classes; DeepSeek-V4's
MTP block against mlx-vlm 0.7.10's deepseek_v4_mtp drafter); a conversion lacking what a head shares is
refused at load time naming the tensor."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from engine.draft.drafter import Context, new_drafter
from engine.model import Model
from helpers import shard_job
from kconvert.convert.shard.job import shard
from kconvert.disk_format.units import GLOBALS, layer_unit
from kconvert.distributed import Group
from kconvert.errors import CheckpointError, UsageError
from kconvert.load.loader import open_converted
from helpers import assert_one_line_error, cli_here, one_thread

TOL = 2e-5  # of the reference logits' largest magnitude, float32

# DeepSeek-V3.2 text that is no preset: other widths, 2 decoder layers (layer 2 is the MTP layer), DSA top-6
V3_TEXT = dict(vocab_size=1024, hidden_size=96, num_attention_heads=3, num_key_value_heads=3, q_lora_rank=48,
               kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, intermediate_size=128,
               moe_intermediate_size=32, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
               topk_group=1, first_k_dense_replace=1, num_hidden_layers=2, routed_scaling_factor=2.0,
               norm_topk_prob=True, index_topk=6, index_n_heads=4, index_head_dim=32, max_position_embeddings=512,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rms_norm_eps=1e-6,
               tie_word_embeddings=False)


def write_v3_with_mtp(out: Path, own_copies: bool, seed: int = 3) -> Path:
    """A DeepSeek-V3.2 checkpoint of V3_TEXT plus one MTP layer (with or without its copies of embed / head)."""
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

    from kconvert.fixtures.models import hf_build
    from kconvert.fixtures.models.k25_dsv32 import write_json
    from kconvert.fixtures.models.mtp import V3MTP
    from kconvert.fixtures.storage.published_names import order_key
    from kconvert.fixtures.storage.shards import write_tensors
    from kconvert.fixtures.tokenizers.kimi import write_kimi_tokenizer

    config = DeepseekV32Config(**V3_TEXT)
    config.architectures, config.dtype = ["DeepseekV32ForCausalLM"], torch.bfloat16
    model = hf_build.new_model(DeepseekV32ForCausalLM, config, seed)
    hf_build.init_weights_(model, seed)
    tensors = hf_build.published_state_dict(model, "deepseek_v32")
    embed, head = tensors["model.embed_tokens.weight"], tensors["lm_head.weight"]
    tensors.update(V3MTP({"model_type": "deepseek_v32", **V3_TEXT}, seed).published(
        2, embed.clone() if own_copies else None, head.clone() if own_copies else None))
    out.mkdir(parents=True)
    write_tensors(out, tensors, sorted(tensors, key=order_key), 2)
    write_json(out / "config.json", {**config.to_dict(), "num_nextn_predict_layers": 1})
    write_kimi_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    """{own_copies: (source, tp 1 conversion)} of the non-preset V3.2 model with an MTP layer."""
    root = tmp_path_factory.mktemp("v3mtp")
    out = {}
    for own in (True, False):
        src = write_v3_with_mtp(root / f"src-{own}", own)
        out[own] = src, Path(shard(shard_job(src, root / f"tp1-{own}", tp=1)).out)
    return out


def head_logits(model: Model, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    head = model.draft_heads[str(model.draft_layers[0])]
    cache = head.new_cache(model, 1, 64, model.kv)
    ctx = Context(model)
    normed, _ = head(ctx, hidden, ids, 0, cache)
    return ctx.logits(normed, head.own("head"))


def rel(got, want) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("own_copies", [True, False], ids=["own-embed-head", "shared-embed-head"])
def test_v3_mtp_head_matches_transformers_layers(v3, own_copies):
    """The engine's MTP layer (eh_proj, an MLA + DSA + MoE block with its own KV cache, shared_head) on random
    target outputs and tokens equals one assembled from transformers' DeepseekV32 classes, the embeddings and
    head its own copies or the target's."""
    from kconvert.fixtures.models.mtp import V3MTP
    from kconvert.verify.reference import EarliestTies

    src, conv = v3[own_copies]
    with one_thread():
        model = Model.from_converted(conv, dtype=torch.float32)
        assert model.draft_layers == [2]
        g = torch.Generator().manual_seed(5)
        S = 23  # past index_topk: the DSA path
        hidden, ids = torch.randn(1, S, 96, generator=g), torch.randint(0, 1024, (1, S), generator=g)
        got = head_logits(model, hidden, ids)
        ref = V3MTP({"model_type": "deepseek_v32", **V3_TEXT}, 3).float().eval()
        embed = model.text.model.embed_tokens.weight.float()
        with torch.no_grad(), EarliestTies():
            want = ref(hidden, ids, embed, model.text.lm_head.weight.float())
    assert rel(got, want) < TOL, rel(got, want)
    # own copies are used when present (and equal the target's here); absent, the target's are
    head = model.draft_heads["2"]
    assert (head.own("embed") is not None) == own_copies and (head.own("head") is not None) == own_copies


def test_v4_mtp_head_matches_mlx_vlm_drafter(tmp_path):
    """DeepSeek-V4's MTP block (e_proj / h_proj, a sliding-window V4 block with its mHC streams, its own hc_head
    and norm, the target's embeddings and head) equals mlx-vlm's deepseek_v4_mtp drafter on the same target
    streams and tokens, on a config that is no preset (hc_mult 3, window 6, tp 1)."""
    mx = pytest.importorskip("mlx.core")
    from mlx_vlm.speculative.drafters.deepseek_v4_mtp import DeepseekV4MTPDraftModel, ModelConfig
    from kconvert.fixtures.models.dsv4 import build_v4_model, write_v4_model
    from dsv4_reference import CONFIGS

    src = tmp_path / "src"
    src.mkdir()
    write_v4_model(build_v4_model(0, dict(CONFIGS["wide"], vocab_size=1024, num_nextn_predict_layers=1)), src, 0)
    conv = shard(shard_job(src, tmp_path / "tp1", tp=1)).out
    cfg = json.loads((src / "config.json").read_text())
    n = cfg["num_hidden_layers"]
    # the drafter's block is sliding only; mlx-vlm's config takes only the released rates 0 / 4 / 128
    drafter = DeepseekV4MTPDraftModel(ModelConfig.from_dict({"text_config": {**cfg, "compress_ratios": [0] * n}}))
    weights = {}
    for f in sorted(src.glob("*.safetensors")):
        weights.update(mx.load(str(f)))
    drafter.load_weights(list(drafter.sanitize({k: v for k, v in weights.items() if k.startswith("mtp.")}).items()),
                         strict=True)
    drafter.set_dtype(mx.float32)
    g = torch.Generator().manual_seed(2)
    S = 17  # past the window: the block's sliding cache is read
    streams = torch.randn(1, S, cfg["hc_mult"], cfg["hidden_size"], generator=g)
    ids = torch.randint(0, 1024, (1, S), generator=g)
    embed, head = (weights[k].astype(mx.float32) for k in ("embed.weight", "head.weight"))
    normed, _ = drafter._forward_hidden(embed[mx.array(ids.numpy())], mx.array(streams.numpy()), mx.array(ids.numpy()),
                                        None)
    import numpy as np

    want = torch.from_numpy(np.array(normed @ head.T))
    with one_thread():
        got = head_logits(Model.from_converted(conv, dtype=torch.float32), streams, ids)
    assert rel(got, want) < TOL, rel(got, want)


def test_heads_are_converted_once_on_the_last_stage_with_the_embeddings(conversion, checkpoint):
    """tp 2 x pp 2: every MTP tensor of the source is in the conversion, on the last stage's ranks only, each rank
    holding each of its names once (split tensors one slice per rank, replicated ones whole on each), and the
    last stage holds the embeddings the heads share."""
    from kconvert.source.checkpoint import Checkpoint

    src = checkpoint("tiny-dsv4")
    ck = Checkpoint.open(src)
    mtp = {n for n in ck.logical if ck.info(n).component == "mtp"}
    conv = open_converted(conversion("tiny-dsv4", tp=2, pp=2))
    cat = conv.catalog
    last = {cat.rank_of(1, r) for r in range(2)}
    seen: dict[int, Counter] = {}
    for r in range(4):
        seen[r] = Counter(t["name"] for t in cat.rank_tensors(r))
        assert all(c == 1 for c in seen[r].values()), r
    on = {r: {n for n in seen[r] if n in mtp or n.removesuffix(".scale") in mtp} for r in seen}
    assert not on[0] and not on[1] and on[2] | on[3] == mtp
    split = {n for n in mtp if ck.info(n).split == "col"}
    assert split and all(n in on[2] and n in on[3] for n in split)  # a slice on each
    assert all("embed.weight" in seen[r] for r in last)
    assert json.loads((Path(conv.root) / "kconvert.json").read_text())["quantization"]["mtp_layers"] == "kept"


def test_no_draft_heads_leaves_them_out_and_keep_mtp_still_parses(checkpoint, tmp_path):
    src = checkpoint("tiny-dsv32-mtp")
    out = tmp_path / "none"
    assert cli_here("shard", src, out, "--tp", 1, "--no-draft-heads").returncode == 0
    cat = open_converted(out).catalog
    assert not any(".layers.3." in t["name"] for t in cat.rank_tensors(0))
    with pytest.raises(UsageError, match="no draft heads"):
        new_drafter(Model.from_converted(out, dtype=torch.float32))
    assert cli_here("shard", src, tmp_path / "kept", "--tp", 1, "--keep-mtp").returncode == 0  # a no-op alias
    assert layer_unit(3) in open_converted(tmp_path / "kept").catalog.units
    assert_one_line_error(cli_here("shard", src, tmp_path / "x", "--tp", 1, "--keep-mtp", "--no-draft-heads"),
                          "--no-draft-heads")


def test_a_head_without_the_embeddings_it_shares_is_refused_naming_them(conversion):
    """The last stage of a pp 2 run whose conversion did not place the embeddings there (nor the head a copy):
    one CheckpointError naming the target tensor the manifest gives, not a head on missing weights."""
    conv = open_converted(conversion("tiny-dsv4", tp=1))
    model = Model(conv.config, conv.family, Group(rank=1, world=2, tp=1, pp=2), dtype=torch.float32,
                  stages=[[0, 1], [2, 3, 4]])
    assert model.draft_layers == [4]
    for unit in conv.catalog.units:
        tensors = conv.load_unit(unit)
        if unit == GLOBALS:
            tensors = {k: v for k, v in tensors.items() if k != "embed.weight"}
        model.take_unit(unit, tensors)
    with pytest.raises(CheckpointError) as e:
        model.check_complete()
    assert e.value.tensor == "embed.weight" and "draft head" in e.value.one_line()
