"""DeepSeek-V4 in the V4-Flash-0731 layout (issue 41): a three-stage DSpark drafter under mtp.0..2 while config.json
says `num_nextn_predict_layers: 1`. The stages are counted from the checkpoint's names and carried by shard (each
tensor once, byte for byte at --quant none, the FP8 blocks bit for bit at --quant fp8), a stage missing a tensor is
refused naming it, mlx-vlm's own drafter (kconvert/verify/mlx_dspark.py) loads the source strictly and runs, and the
engine's drafter (engine/models/deepseek_v4/dspark.py) gives its predictions.
On the preset and on a config that is none (other widths, target layers out of order, rank, block size; bf16)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from helpers import assert_one_line_error, cli_here, load_source
from kconvert.family.manifest import bind
from kconvert.load.loader import open_converted
from kconvert.source.checkpoint import Checkpoint
from test_dsv4_bad_input import rewrite
from test_dsv4_shard import expected

OTHER = {"hidden_size": 192, "moe_intermediate_size": 96, "q_lora_rank": 96}
OTHER_DSPARK = {"dspark_target_layer_ids": [3, 0], "dspark_block_size": 3, "dspark_markov_rank": 8,
                "dspark_noise_token_id": 7}


@pytest.fixture(scope="module")
def preset(checkpoint):
    return checkpoint("tiny-dsv4-dspark")


@pytest.fixture(scope="module")
def trained(checkpoint):
    return checkpoint("tiny-dsv4-dspark-trained")  # its drafter trained on the target's hidden states (bf16)


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    from kconvert.fixtures.models.dsv4_dspark import write_dspark_v4

    out = tmp_path_factory.mktemp("dspark_other") / "src"
    write_dspark_v4(out, seed=5, storage=None, overrides=OTHER, dspark=OTHER_DSPARK)
    return out


def test_stages_are_counted_from_the_checkpoint(preset, checkpoint):
    ck = Checkpoint.open(preset)
    config = json.loads((preset / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
    assert ck.model.text.extra_layers == 3 and bind(config).text.extra_layers == 1  # a config alone: its count
    assert ck.model.family["engine"]["draft"] == "v4_dspark"
    ck.validate()
    assert ck.info("mtp.0.main_proj.weight").layer == 4 and ck.info("mtp.2.markov_head.markov_w2.weight").layer == 6
    proc = cli_here("inspect", preset)
    assert proc.returncode == 0 and "3 MTP" in proc.stdout, proc.stderr
    v4 = Checkpoint.open(checkpoint("tiny-dsv4"))  # V4's MTP block: as before
    assert v4.model.family["engine"]["draft"] == "v4_mtp" and v4.model.text.extra_layers == 1
    assert v4.info("mtp.0.e_proj.weight").layer == 4


@pytest.mark.parametrize("which,tp", [("preset", 1), ("other", 2)])
def test_none_carries_every_drafter_tensor(request, tmp_path, which, tp):
    src = request.getfixturevalue(which)
    out = tmp_path / "out"
    proc = cli_here("shard", src, out, "--tp", tp, "--quant", "none")
    assert proc.returncode == 0, proc.stderr
    ck = Checkpoint.open(src)
    drafter = {n for n in ck.logical if n.startswith("mtp.")}
    assert {"mtp.0.main_proj.weight", "mtp.2.hc_head_fn", "mtp.2.confidence_head.proj.bias",
            "mtp.1.ffn.experts.7.w2.weight"} <= drafter and not any(".e_proj." in n for n in drafter)
    stored = load_source(src)
    for rank in range(tp):
        conv = open_converted(out, rank)
        got = {}
        for unit in conv.catalog.units:
            for name, t in conv.load_unit(unit, verify=True).items():
                assert name not in got, name  # once a rank
                got[name] = t
        mine = {n for n in drafter if expected(ck, n, rank, tp) is not None}
        assert {n for n in got if n.startswith("mtp.")} == mine
        for name in mine:
            want = expected(ck, name, rank, tp)
            assert got[name].dtype == want.dtype and torch.equal(got[name], want), (rank, name)
    if which == "other":  # a bf16 source: a replicated drafter tensor keeps the stored bytes
        name = "mtp.0.main_proj.weight"
        assert torch.equal(got[name].view(torch.uint8), stored[name].view(torch.uint8))
        assert got[name].shape == (192, 2 * 192)


def test_fp8_keeps_the_drafter_fp8_blocks_bit_for_bit(preset, tmp_path):
    out = tmp_path / "out"
    proc = cli_here("shard", preset, out, "--tp", 1, "--quant", "fp8")
    assert proc.returncode == 0, proc.stderr
    ck = Checkpoint.open(preset)
    stored = load_source(preset)
    conv = open_converted(out, 0)
    got = {}
    for unit in conv.catalog.units:
        got.update(conv.load_unit(unit, verify=True))
    blocks = [n for n, t in ck.logical.items() if n.startswith("mtp.") and t.format == "block_fp8"]
    assert "mtp.0.main_proj.weight" in blocks and len(blocks) == 3 * 8 + 1  # 5 attention + 3 shared-expert linears
    for name in blocks:
        assert torch.equal(got[name].view(torch.uint8), stored[name].view(torch.uint8)), name
        assert torch.equal(got[name + "_scale_inv"], stored[name[:-len("weight")] + "scale"].float()), name
    for name in ("mtp.2.markov_head.markov_w1.weight", "mtp.2.hc_head_fn"):  # kept as stored
        assert torch.equal(got[name], stored[name]), name


def drop_stage(src, stage: int) -> None:
    for name in [n for n in json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
                 if n.startswith(f"mtp.{stage}.")]:
        rewrite(src, drop=name)


@pytest.mark.parametrize("name", ["mtp.1.attn_norm.weight", "mtp.2.markov_head.markov_w2.weight",
                                  "mtp.0.main_norm.weight"])
def test_a_stage_missing_a_tensor_is_refused_naming_it(preset, copy_checkpoint, tmp_path, name):
    src = copy_checkpoint(preset)
    rewrite(src, drop=name)
    assert_one_line_error(cli_here("inspect", src), f"tensor {name}", "required by the deepseek_v4 manifest")
    out = tmp_path / "out"
    assert_one_line_error(cli_here("shard", src, out, "--tp", 1), f"tensor {name}")
    assert not out.exists()


def test_a_stage_past_a_missing_one_is_not_known(preset, copy_checkpoint):
    src = copy_checkpoint(preset)
    drop_stage(src, 1)
    assert_one_line_error(cli_here("inspect", src), "tensor mtp.2.", "not known to the deepseek_v4 manifest")


def test_without_its_drafter_the_layout_still_converts(preset, copy_checkpoint):
    src = copy_checkpoint(preset)
    for stage in range(3):
        drop_stage(src, stage)
    ck = Checkpoint.open(src)
    ck.validate()
    assert ck.model.text.extra_layers == 1 and not any(n.startswith("mtp.") for n in ck.logical)


@pytest.mark.parametrize("which", ["preset", "other"])
def test_the_mlx_reference_runs_and_its_markov_head_counts(request, which):
    import mlx.core as mx

    from kconvert.verify.mlx_dspark import V4DsparkReference

    src = request.getfixturevalue(which)
    config = json.loads((src / "config.json").read_text())
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    targets, block = len(config["dspark_target_layer_ids"]), config["dspark_block_size"]
    ref = V4DsparkReference(src)
    assert len(ref.model.stages) == 3 and ref.block == block
    S = 12
    gen = torch.Generator().manual_seed(11)
    taps = torch.randn(1, S, targets * hidden, generator=gen)
    tokens = torch.randint(0, vocab - 1, (1, S), generator=gen)
    first = ref.logprobs(taps, tokens)
    assert first.shape == (S, vocab) and first.dtype == torch.float32 and bool(first.isfinite().all())
    rows = ref.block_logprobs(taps, tokens)
    assert rows.shape == (S, block, vocab) and bool(rows.isfinite().all())
    assert torch.allclose(rows[:, 0], first, atol=1e-5)
    w2 = ref.model.markov_head.markov_w2.weight
    ref.model.markov_head.markov_w2.weight = mx.zeros_like(w2)
    assert (ref.logprobs(taps, tokens).argmax(-1) != first.argmax(-1)).any()  # the Markov bias moves the draft


@pytest.mark.parametrize("which", ["preset", "other", "trained"])
def test_the_engines_drafter_is_mlx_vlms(request, tmp_path, which):
    """The engine's DSpark drafter over V4 stages (engine/models/deepseek_v4/dspark.py) gives mlx-vlm's deepseek_v4_dspark
    drafter's first-draft log-probs at every position (mean KLD < 1e-5, float32; the context read past its window
    of 8), on the preset (FP8 / FP4), on the non-preset config (targets out of order, blocks of 3) and on the trained
    preset (trained through the engine's drafter: kconvert/fixtures/training/dspark.py); greedy decoding drafted by it
    is plain greedy decoding."""
    from engine.draft.drafter import new_drafter
    from engine.model import Model
    from engine.runtime.generate import Sampling, generate
    from engine.runtime.speculative import generate_speculative
    from kconvert.verify.mlx_dspark import V4DsparkReference

    src, out = request.getfixturevalue(which), tmp_path / "out"
    proc = cli_here("shard", src, out, "--tp", 1, "--quant", "none")
    assert proc.returncode == 0, proc.stderr
    model = Model.from_converted(out, dtype=torch.float32)
    prompt = [(7 * i + 3) % 250 + 2 for i in range(21)]
    drafter, hidden, ids = new_drafter(model), [], torch.tensor([prompt])
    assert model.tap_layers == json.loads((src / "config.json").read_text())["dspark_target_layer_ids"]
    model.forward(ids, last_only=True, everywhere=False, hidden=hidden)
    taps = torch.cat(hidden, 1)[:, :-1]
    ours = drafter.score(taps, ids[:, 1:]).log_softmax(-1)
    ref = V4DsparkReference(src).logprobs(taps, ids[:, 1:])
    kld = (ref.exp() * (ref - ours)).sum(-1)
    assert kld.mean() < 1e-5 and torch.equal(ref.argmax(-1), ours.argmax(-1)), kld
    plain = generate(model, prompt, Sampling(max_new_tokens=12)).tokens
    spec = generate_speculative(model, prompt, Sampling(max_new_tokens=12))
    assert spec.tokens == plain and sum(spec.stats.proposed) > 0
