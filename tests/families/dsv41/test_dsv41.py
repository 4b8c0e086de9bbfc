"""DeepSeek-V4.1 as released, against the independent reference (mlx-vlm 0.7.10's deepseek_v41 on MLX's CPU backend,
its activation fake-quantization off), on a V4.1 config that is not the tiny preset (other compression ratios and
roles, another candidate source, Engram with 4-grams on other layers, 3 residual streams): the fixture is what
mlx-vlm loads strictly; conversions at tp 1, tp 2 and tp 2 x pp 2 (a stage boundary after the KV source whose
entries, keys, choice and candidate blocks the next stage reads) give its log-probs; `--quant fp8` copies the
32 x 32 FP8 blocks bit for bit; a damaged conversion FAILs verify with its layer named; a config whose roles do not
line up, or a conversion without its Engram token map, is one line; the DSpark drafter travels with conversions;
the Engram tables keep their FP8 rows. Over 300 lines: one module fixture (the non-preset V4.1, its three
conversions and its MLX reference: a minute to build) serves every test here."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from helpers import ROOT, cli_here, one_thread, verify_json
from kconvert.fixtures.models.dsv41 import v41_config, write_v41_checkpoint
from kconvert.verify import damage

# not the preset: 7 layers; ratios 1 and 2; KV sources 1 and 3 (layer 2 reads 1's entries, 4-5 read 3's); indexers
# on 1 and 3 (their own keys) and 5 (3's keys, inside 3's candidate blocks); Engram 4-grams on 0 and 4; 3 streams;
# DSpark blocks of 3, Markov rank 12, the drafter's own bank of 4 experts (2 a token)
OTHER = {"num_hidden_layers": 7, "hidden_size": 192, "num_attention_heads": 4, "head_dim": 96, "qk_rope_head_dim": 32,
         "q_lora_rank": 96, "o_groups": 2, "o_lora_rank": 96, "moe_intermediate_size": 128, "n_routed_experts": 8,
         "num_experts_per_tok": 3, "sliding_window": 6, "compress_ratios": [0, 1, 1, 2, 2, 2, 0],
         "kv_source_layer_ids": [1, 3], "index_source_layer_ids": [1, 3, 5], "candidate_source_layer_id": 3,
         "candidate_topk_blocks": 2, "candidate_block_size": 2, "index_n_heads": 2, "index_head_dim": 64,
         "index_topk": 3, "hc_mult": 3, "engram_layer_ids": [0, 4], "engram_max_ngram_size": 4,
         "engram_vocab_size": 101, "engram_n_heads": 2, "engram_head_dim": 64, "dspark_block_size": 3,
         "dspark_markov_rank": 12, "dspark_n_routed_experts": 4, "dspark_num_experts_per_tok": 2}
# As V4.1-Flash ships its drafter: its stages route over their own, smaller bank (the release: 128 / 3 a token beside
# 384 / 6) and its confidence head has no bias (vLLM's V4.1 DSpark builds it without one).


@pytest.fixture(scope="module")
def v41(tmp_path_factory):
    """The non-preset V4.1 (FP8 32 x 32 + FP4 experts) with its conversions and its MLX reference."""
    d = tmp_path_factory.mktemp("v41")
    write_v41_checkpoint(d / "src", v41_config(OTHER), seed=4, confidence_bias=False)
    for args in (("shard", d / "src", d / "tp1", "--tp", 1),
                 ("shard", d / "src", d / "tp2", "--tp", 2),
                 ("shard", d / "src", d / "tp2pp2", "--tp", 2, "--pp", 2, "--pp-layers", "0-3,4-6"),
                 ("reference", d / "src", "--out", d / "ref.safetensors", "--hidden-states")):
        r = cli_here(*args)
        assert r.returncode == 0, r.stderr
    return d


verify = verify_json


def test_the_fixture_is_what_mlx_vlm_loads_and_its_loop_is_mlx_vlms_forward(v41):
    """mlx-vlm loads the released layout strictly, and the reference's own loop over its layers (which reads the
    states between them) gives the model's own logits."""
    import mlx.core as mx
    import numpy as np

    from kconvert.verify.mlx_reference import MlxDeepseekV41

    ref = MlxDeepseekV41(v41 / "src", torch.float32)
    ids = torch.tensor([[1, 5, 9, 17, 33, 65, 129, 200, 7, 3, 11, 5, 9, 17]])
    ours = ref(ids, output_hidden_states=True)
    own = np.array(ref.model(mx.array(ids.numpy())).logits.astype(mx.float32))
    assert np.abs(ours.logits.numpy() - own).max() < 1e-5
    assert len(ours.hidden_states) == OTHER["num_hidden_layers"] + 1


def test_inspect_names_every_v41_component(v41):
    r = cli_here("inspect", v41 / "src", "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["family"] == "deepseek_v41" and s["quantization"]["scheme"] == "fp8"
    assert {"attention", "compressor", "indexer", "mhc", "engram", "routed_experts", "vision", "projector"} <= set(s["params"])
    assert s["model"]["layer_kinds"]["kv_role"] == {"reader": 5, "source": 2}
    assert s["model"]["layer_kinds"]["compress"] == {"window": 2, "every_token": 2, "pooled": 3}


@pytest.mark.parametrize("layout", ["tp1", "tp2", "tp2pp2"])
def test_conversions_give_mlx_vlms_log_probs(v41, layout):
    r, rep = verify(v41 / layout, v41 / "ref.safetensors", "--per-layer")
    assert r.returncode == 0 and rep["verdict"] == "PASS", r.stderr
    assert rep["cost"]["overall"]["mean_kld"] < 1e-5, rep["cost"]["overall"]  # vs mlx-vlm on the release itself
    assert rep["fault_at"] is None


def test_fp8_copies_the_32x32_blocks(v41, tmp_path):
    """The release's FP8 linears are copied bit for bit (their 32 x 32 scales with them), the FP4 experts re-encoded
    exactly into the same blocks: the conversion gives the reference's log-probs."""
    from safetensors import safe_open

    out = tmp_path / "fp8"
    r = cli_here("shard", v41 / "src", out, "--tp", 2, "--quant", "fp8")
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "kconvert.json").read_text())["quantization"]["block_size"] == [32, 32]
    name = "layers.3.attn.wq_b.weight"

    def read(folder, key):
        for f in sorted(folder.rglob("*.safetensors")):
            with safe_open(str(f), "pt") as h:
                if key in h.keys():
                    return h.get_tensor(key)

    src, rank1 = read(v41 / "src", name), read(out / "rank-001", name)
    assert torch.equal(src[src.shape[0] // 2:].view(torch.uint8), rank1.view(torch.uint8))
    for name in ("mtp.0.main_proj.weight", "mtp.1.attn.wq_a.weight"):  # the DSpark stages: replicated, copied
        assert torch.equal(read(v41 / "src", name).view(torch.uint8), read(out / "rank-001", name).view(torch.uint8))
    r, rep = verify(out, v41 / "ref.safetensors")
    assert r.returncode == 0 and rep["cost"]["overall"]["mean_kld"] < 1e-5, rep["cost"]["overall"]


@pytest.mark.parametrize("what,name,layer", [
    ("a KV source's compressor", "layers.3.attn.compressor.wkv.weight", 3),
    ("an indexer's key projection", "layers.1.attn.indexer.wk.weight", 1),
    ("an Engram gate", "layers.4.engram.q_weight", 4),
])
def test_damage_fails_verify_with_the_layer_named(v41, tmp_path, what, name, layer):
    out = tmp_path / "damaged"
    shutil.copytree(v41 / "tp1", out)
    damage.rewrite(out, damage.files_holding(out, name)[0], lambda t: t[name].mul_(-1.0))
    r, rep = verify(out, v41 / "ref.safetensors", "--per-layer")
    assert r.returncode == 1 and rep["faithfulness"]["verdict"] == "FAIL", (what, r.stderr)
    assert rep["fault_at"] == f"layer {layer}", (what, rep["fault_at"])


def test_roles_of_other_rates_are_one_line(tmp_path):
    """A compressed layer reading entries of one rate through a choice made at another cannot run as a model: the
    references would index one rate's entries by the other's positions. Refused when the config is bound (inspect,
    shard, and the engine's own reading, which binds first), naming the key."""
    from engine.config import model_config
    from kconvert.errors import ManifestError
    from kconvert.family.manifest import bind

    bad = v41_config({**OTHER, "index_source_layer_ids": [1, 5], "candidate_source_layer_id": 5})  # layer 3 (rate 2)
    # reuses 1's choice (rate 1)
    for read in (bind, lambda c: model_config(c, "deepseek_v41")):
        with pytest.raises(ManifestError, match=r"compress_ratios: layer 3 reads compressed state made at other "
                                                r"rates .*indexer 1's 1"):
            read(bad)


def test_a_conversion_without_its_engram_token_map_is_one_line(v41, tmp_path):
    out = tmp_path / "no-map"
    shutil.copytree(v41 / "tp1", out)
    (out / "engram_token_map.json").unlink()
    r, _ = verify(out, v41 / "ref.safetensors")
    assert r.returncode == 2 and "engram_token_map.json is absent" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_the_engram_normalisation_is_the_tokenizers_one():
    """The compressed ids' text normalisation (engine/models/deepseek_v41/engram_tokens.py) against the `tokenizers`
    normalizer sequence the reference builds its map with."""
    from tokenizers import Regex, normalizers

    from engine.models.deepseek_v41.engram_tokens import normalise

    sentinel = "\ue000"
    ref = normalizers.Sequence([normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
                                normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), sentinel),
                                normalizers.Strip(), normalizers.Replace(sentinel, " ")])
    for text in [" The", "the", "THE", "Ünïcödé", "\tTab\n", " ", "\n\n", "ﬁ ligature", "Ｆｕｌｌ", " x  y ", "Ǆ", "é"]:
        assert normalise(text) == ref.normalize_str(text), repr(text)


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_kv_bytes_are_what_the_cache_holds(v41, kv_dtype):
    """kconvert plan's KV bytes (kconvert/plan/kv_bytes.py) equal the engine cache's, at every length."""
    from engine.cache.latent import KVOptions
    from engine.model import Model
    from kconvert.plan.kv_bytes import kv_bytes

    model = Model.from_converted(v41 / "tp1", dtype=torch.float32)
    plan = kv_bytes(json.loads((v41 / "src" / "config.json").read_text())["text_config"], kv_dtype)
    cache = model.new_cache(2, 64, kv=KVOptions(kv_dtype))
    for length, new in ((5, 5), (6, 1), (23, 17), (24, 1)):
        model.forward(torch.randint(1, 900, (2, new)), cache)
        assert cache.bytes_in_use() == 2 * plan.context_bytes(length), (length, cache.bytes_in_use(), plan)


def test_decoding_in_steps_is_one_forward(v41):
    """The cache carries every piece of V4.1 state from step to step (the window, a pooled group still filling up,
    entries, index keys, the Engram look-back): prefill and decode in uneven steps give one forward's logits."""
    from engine.model import Model

    model = Model.from_converted(v41 / "tp1", dtype=torch.float32)
    ids = torch.randint(1, 900, (2, 30), generator=torch.Generator().manual_seed(7))
    whole = model.forward(ids, model.new_cache(2, 64))
    cache, at, parts = model.new_cache(2, 64), 0, []
    for n in (5, 1, 1, 13, 1, 9):
        parts.append(model.forward(ids[:, at:at + n], cache))
        at += n
    assert (torch.cat(parts, 1) - whole).abs().max() < 1e-4


def stored_names(folder) -> set[str]:
    from safetensors import safe_open

    names = set()
    for f in sorted(folder.rglob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            names |= set(h.keys())
    return names


def test_the_dspark_drafter_travels_with_the_conversion(v41, tmp_path):
    """The release's DSpark stages (mtp.0.., main_proj / main_norm on the first, the Markov and confidence heads on the
    last) are every rank's in a conversion (as vLLM loads them), none with --no-draft-heads; the engine builds them
    as its drafter on the one, and on the other runs the target and says in one line that --speculative needs them."""
    from engine.draft.drafter import new_drafter
    from engine.model import Model
    from kconvert.errors import UsageError

    drafts = {n for n in stored_names(v41 / "src") if n.startswith("mtp.")}
    assert {"mtp.0.main_proj.weight", "mtp.0.main_norm.weight", "mtp.1.norm.weight", "mtp.1.markov_head.embed.weight",
            "mtp.1.markov_head.head.weight", "mtp.1.confidence_head.proj.weight", "mtp.1.ffn.experts.3.w2.weight"} <= drafts
    assert "mtp.1.main_proj.weight" not in drafts and "mtp.0.markov_head.embed.weight" not in drafts
    assert "mtp.1.ffn.experts.4.w2.weight" not in drafts and "mtp.1.confidence_head.proj.bias" not in drafts
    for rank in ("rank-000", "rank-001"):
        held = {n for n in stored_names(v41 / "tp2" / rank) if n.startswith("mtp.")}
        assert {n for n in drafts if not n.endswith(".scale") and ("experts." not in n or "shared_" in n)} <= held
    out = tmp_path / "no-drafts"
    r = cli_here("shard", v41 / "src", out, "--tp", 1, "--no-draft-heads")
    assert r.returncode == 0, r.stderr
    assert not {n for n in stored_names(out) if n.startswith("mtp.")}
    r, rep = verify(out, v41 / "ref.safetensors")
    assert r.returncode == 0 and rep["verdict"] == "PASS", r.stderr
    with one_thread():
        model = Model.from_converted(v41 / "tp1", dtype=torch.float32)
        bare = Model.from_converted(out, dtype=torch.float32)
    assert sorted(model.draft_heads) == ["7", "8"]
    assert new_drafter(model).k == OTHER["dspark_block_size"]
    with pytest.raises(UsageError, match=r"holds no draft heads"):
        new_drafter(bare)


def test_the_drafter_routes_over_its_own_expert_bank(v41):
    """The DSpark stages' own bank (4 experts, 2 a token, beside the backbone's 8 / 3) is what inspect reports, what
    plan counts on every rank, where a tp 2 conversion places the stages' experts (2 whole experts a rank, by their own
    bank), and what the engine's stages route over."""
    from engine.model import Model
    from kconvert.plan.memory import make_plan

    r = cli_here("inspect", v41 / "src", "--json")
    assert r.returncode == 0, r.stderr
    model = json.loads(r.stdout)["model"]
    assert (model["routed_experts"], model["experts_per_token"], model["draft_experts"]) == (8, 3, [4, 2])
    for rank, own in (("rank-000", {0, 1}), ("rank-001", {2, 3})):
        held = {int(n.split(".")[4]) for n in stored_names(v41 / "tp2" / rank) if n.startswith("mtp.1.ffn.experts.")}
        assert held == own, rank
    plan = make_plan(str(v41 / "src"), tp=2)
    assert plan.rank["bytes"]["mtp"] > 0 and plan.params["mtp"] > 0
    with one_thread():
        m = Model.from_converted(v41 / "tp1", dtype=torch.float32)
    for stage in m.draft_heads.values():
        assert (stage.c.experts, stage.c.top_k) == (4, 2) and len(stage.ffn.experts) == 4


@pytest.mark.parametrize("missing", ["mtp.1.markov_head.embed.weight", "mtp.0.main_proj.weight",
                                     "mtp.1.ffn.experts.3.w1.weight", "mtp.1.attn.wkv.weight"])
def test_a_drafter_stage_missing_a_tensor_is_refused_before_any_work(tmp_path, missing):
    """A drafter the checkpoint holds is whole or refused, naming the tensor (not converted, then refused by chat)."""
    from helpers import assert_one_line_error

    src = tmp_path / "src"
    gone = (missing, missing.removesuffix("weight") + "scale")  # a quantized weight goes with its scale
    write_v41_checkpoint(src, v41_config(OTHER), seed=4, confidence_bias=False,
                         without=gone)
    assert_one_line_error(cli_here("shard", src, tmp_path / "out", "--tp", 1), missing)
    assert not (tmp_path / "out" / "kconvert.json").exists()


def test_a_whole_missing_stage_is_refused_and_a_missing_drafter_is_not(tmp_path):
    """The config counts 2 stages: a checkpoint with only mtp.0 is refused naming the absent stage's first tensor; one
    with no drafter at all converts (the target alone, as --no-draft-heads would)."""
    from helpers import assert_one_line_error

    cfg = v41_config(OTHER)
    src = tmp_path / "one-stage"
    write_v41_checkpoint(src, cfg, seed=4, without=("mtp.1.",))
    assert_one_line_error(cli_here("inspect", src), "mtp.1.")
    bare = tmp_path / "no-drafter"
    write_v41_checkpoint(bare, cfg, seed=4, without=("mtp.",))
    assert cli_here("inspect", bare).returncode == 0


@pytest.mark.parametrize("change,needle", [
    ({"dspark_target_layer_ids": [5, 6, 7]}, "text_config.dspark_target_layer_ids names layer 7: layers are 0..6"),
    ({"dspark_target_layer_ids": 5}, "text_config.dspark_target_layer_ids = 5: must be a list"),
    ({"dspark_markov_rank": 10**9}, "text_config.dspark_markov_rank = 1000000000: outside [0, 65536]"),
    ({"engram_n_heads": 10**9}, "text_config.engram_n_heads = 1000000000: outside [1, 4096]"),
    ({"dspark_num_experts_per_tok": 5}, "num_experts_per_tok <= n_routed_experts"),
    ({"dspark_n_routed_experts": "4"}, "text_config.dspark_n_routed_experts = '4': must be an integer"),
])
def test_a_bad_drafter_config_is_one_line(tmp_path, change, needle):
    from helpers import assert_one_line_error

    src = tmp_path / "src"
    write_v41_checkpoint(src, v41_config(OTHER), seed=4)
    cfg = json.loads((src / "config.json").read_text())
    cfg["text_config"].update(change)
    (src / "config.json").write_text(json.dumps(cfg))
    assert_one_line_error(cli_here("inspect", src), "config.json", needle)


def test_a_drafter_tensor_of_the_wrong_shape_is_named(v41, tmp_path):
    """The first stage's context projection is as wide as the target layers it reads: one more or fewer is refused,
    naming the tensor, not loaded into a drafter that would draft nothing useful."""
    from helpers import assert_one_line_error

    src = tmp_path / "src"
    shutil.copytree(v41 / "src", src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["text_config"]["dspark_target_layer_ids"] = [5, 6]
    (src / "config.json").write_text(json.dumps(cfg))
    assert_one_line_error(cli_here("inspect", src), "mtp.0.main_proj.weight")


def test_plan_judges_fp8_alignment_by_the_sources_own_blocks(tmp_path):
    """V4.1-Flash at tp 8: its shared expert splits into 288-wide slices, aligned to the release's 32 x 32 FP8 blocks
    (copied as they are) but not to 128 x 128 ones: plan warns only for a source whose blocks they straddle."""
    from kconvert.family.families import manifests_dir
    from kconvert.plan.memory import make_plan

    def straddles(block: int) -> bool:
        cfg = json.loads((manifests_dir() / "examples" / "deepseek-v41-flash" / "config.json").read_text())
        cfg["quantization_config"]["weight_block_size"] = [block, block]
        d = tmp_path / str(block)
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
        return any("straddle" in w for w in make_plan(str(d), tp=8, quant="fp8").warnings)

    assert not straddles(32) and straddles(128)


def test_the_engram_tables_keep_the_releases_fp8_rows(v41):
    """Every scheme copies an Engram table as stored: each rank's run of whole rows, FP8 values and their e8m0 scales
    bit for bit (half the bytes of bf16; the conversions above verify against the reference with them)."""
    from safetensors import safe_open

    def tensors(folder):
        out = {}
        for f in sorted(folder.glob("*.safetensors")):
            with safe_open(str(f), "pt") as h:
                out.update({k: h.get_tensor(k) for k in h.keys() if ".engram.embed." in k or k.endswith("embed.scale")})
        return out

    src = tensors(v41 / "src")
    w, s = src["layers.4.engram.embed.weight"], src["layers.4.engram.embed.scale"]
    per = -(-w.shape[0] // 2)
    for rank, rows in ((0, slice(0, per)), (1, slice(per, None))):
        got = tensors(v41 / "tp2" / f"rank-{rank:03d}")
        assert got["layers.4.engram.embed.weight"].dtype == torch.float8_e4m3fn
        assert torch.equal(got["layers.4.engram.embed.weight"].view(torch.uint8), w[rows].view(torch.uint8))
        assert torch.equal(got["layers.4.engram.embed.weight_scale"].view(torch.uint8), s[rows].view(torch.uint8))


def test_plan_counts_the_engram_tables_as_fp8_rows():
    """V4.1-Flash at tp 8: its two Engram tables (384M rows of 256) in FP8 rows, an eighth of their rows per rank."""
    from kconvert.plan.memory import make_plan

    rows = -(-384_006_168 // 8) + -(-384_016_682 // 8)
    tables = rows * (256 + 256 // 32)  # e4m3 values + one e8m0 scale per 32 (bf16: rows * 512)
    for quant in ("none", "fp8", "int4"):
        engram = make_plan("deepseek-v41-flash", tp=8, quant=quant).rank["bytes"]["engram"]
        assert tables < engram < tables + 700_000_000, (quant, engram)  # + the two layers' projections and gates


def test_dspark_speculative_decoding_is_plain_greedy(v41):
    """Greedy decoding drafted by the DSpark stages (blocks of 3 past a window of 6, each round's rejected tokens
    rolled back through the pooled and every-token sources, the indexers and the Engram look-back) is plain greedy
    decoding token for token, and the drafter's first drafts in decoding are what its batched scoring predicts."""
    from engine.draft.drafter import new_drafter
    from engine.model import Model
    from engine.runtime.generate import Sampling, generate
    from engine.runtime.speculative import generate_speculative

    prompt = [(7 * i + 3) % 250 + 2 for i in range(23)]
    with one_thread():
        model = Model.from_converted(v41 / "tp1", dtype=torch.float32)
        plain = generate(model, prompt, Sampling(max_new_tokens=20)).tokens
        spec = generate_speculative(model, prompt, Sampling(max_new_tokens=20))
        assert spec.tokens == plain
        assert sum(spec.stats.proposed) > 0
        drafter, hidden = new_drafter(model), []
        ids = torch.tensor([prompt])
        model.forward(ids, last_only=True, everywhere=False, hidden=hidden)
        x = torch.cat(hidden, 1)[:, :-1]
        scored = drafter.score(x, ids[:, 1:])
        drafter.start(64)
        for i in range(x.shape[1]):  # one position a block, as decoding reads them
            drafter.extend(x[:, i:i + 1], [prompt[i + 1]])
            assert drafter.draft(1) == [int(scored[i].argmax())], i


def test_dspark_damage_fails_verify_naming_the_drafter(v41, tmp_path):
    """A conversion whose Markov head was lost (zeros, as a loader that skipped it leaves it) FAILs verify's draft
    check on its predictions, naming the drafter; the target itself is unharmed (faithfulness PASS)."""
    out = tmp_path / "damaged"
    shutil.copytree(v41 / "tp1", out)
    damage.zero(out, "mtp.1.markov_head.embed.weight")
    r, rep = verify(out, v41 / "ref.safetensors")
    assert r.returncode == 1 and rep["faithfulness"]["verdict"] == "PASS", r.stderr
    assert rep["draft"]["verdict"] == "FAIL" and rep["draft"]["heads"][0]["head"] == "mtp.0", rep["draft"]
    assert any("draft head mtp.0: predictions' mean KLD" in f for f in rep["failures"]), rep["failures"]


def test_dspark_taps_cross_pipeline_stages(v41, tmp_path):
    """A pipeline layout that puts a tapped layer (4) before the last stage: the taps travel with the residual, so
    verify's draft check runs there (its predictions the tp 1 conversion's, its acceptance the source drafter's) and
    speculative chat writes plain greedy chat's text."""
    out = tmp_path / "pp2"
    r = cli_here("shard", v41 / "src", out, "--tp", 1, "--pp", 2, "--pp-layers", "0-4,5-6")
    assert r.returncode == 0, r.stderr
    r, rep = verify(out, v41 / "ref.safetensors")
    assert r.returncode == 0 and rep["verdict"] == "PASS" and rep["draft"]["verdict"] == "PASS", r.stderr
    assert rep["draft"]["heads"][0]["mean_kld"] < 1e-5, rep["draft"]

    def chat(*extra):
        p = subprocess.run([sys.executable, "-m", "engine.chat", str(out), "--complete", "--prompt", "def f(x):",
                            "--max-new-tokens", "12", "--dtype", "fp32", *extra], cwd=ROOT, capture_output=True,
                           text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        return p.stdout.split("[TTFT")[0]

    assert chat("--speculative") == chat()
