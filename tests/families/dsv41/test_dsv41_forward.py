"""DeepSeek-V4.1's forward on a text-only config shaped like the release (kconvert/fixtures/models/dsv41.py
RELEASE_LIKE_V41_TEXT: ratio-0 layers first, then 2, then 1, separate KV / index / candidate sources, top-6 of 16
experts, routed scale 1.5, eps 1e-20, 4 streams, the release's YaRN) at tiny widths, in the release's FP8 32 x 32 /
MXFP4 storage: the engine's float32 logits against both MLX references, mlx-vlm's deepseek_v41 (verify's reference)
and mlx-lm's. Both run with their activation rounding off (mlx-vlm's `fakequant.DISABLE`, as verify runs it; mlx-lm's
FP8 / FP4 rounding of the KV, queries and keys, which it applies on every forward and which alone makes a mean KLD
of 1e-3 to 5e-2 on such configs: kconvert/verify/mlx_reference.py MlxLmDeepseekV41), and must agree with each other
first, so a failure here is the engine's.

`swiglu_limit` 0 means no clamp to both references (they clamp only when the limit is positive): an engine that
clamps at 0 zeroes every expert's positive gate half (mean KLD 0.86 here)."""

from __future__ import annotations

import pytest
import torch

from helpers import cli_here, one_thread, verify_json
from kconvert.fixtures.models.dsv41 import RELEASE_LIKE_V41_TEXT, v41_config, write_v41_checkpoint

PROMPT = 24  # past the window of 8: the compressed entries, the indexers' top-4 and the candidate blocks all matter


def mean_kld(p: torch.Tensor, q: torch.Tensor) -> float:
    lp, lq = torch.log_softmax(p.double(), -1), torch.log_softmax(q.double(), -1)
    return float((lp.exp() * (lp - lq)).sum(-1).mean())


@pytest.mark.parametrize("swiglu_limit", [10.0, 0.0])
def test_a_release_like_v41_is_both_mlx_references(tmp_path, swiglu_limit):
    from engine.model import Model
    from kconvert.verify.mlx_reference import MlxDeepseekV41, MlxLmDeepseekV41

    config = v41_config({**RELEASE_LIKE_V41_TEXT, "swiglu_limit": swiglu_limit})
    write_v41_checkpoint(tmp_path / "src", config, seed=11)
    r = cli_here("shard", tmp_path / "src", tmp_path / "tp1", "--tp", 1, "--quant", "none")
    assert r.returncode == 0, r.stderr
    text = torch.randint(2, min(config["image_token_id"], config["text_config"]["bos_token_id"]), (1, PROMPT),
                         generator=torch.Generator().manual_seed(11))  # text tokens only: image ones take bias_vl
    with one_thread():
        engine = Model.from_converted(tmp_path / "tp1", dtype=torch.float32).forward(text).float()
    vlm = MlxDeepseekV41(tmp_path / "src", torch.float32)(text).logits
    lm = MlxLmDeepseekV41(tmp_path / "src")(text)
    assert mean_kld(vlm, lm) < 1e-8, "the two MLX references disagree: not the engine's difference to judge"
    against_vlm, against_lm = mean_kld(vlm, engine), mean_kld(lm, engine)
    assert against_vlm < 1e-5 and against_lm < 1e-5, (against_vlm, against_lm)


def test_mlx_lms_own_rounding_is_what_stands_between_it_and_the_engine(tmp_path):
    """mlx-lm as it ships (its KV / query / key rounding on) is 1e-3-class away on the same checkpoint, and the
    wrapper puts its rounding functions back after each call (a later mlx-lm user gets mlx-lm as it ships)."""
    import mlx_lm.models.deepseek_v41 as lm_v41

    from kconvert.verify.mlx_reference import MlxLmDeepseekV41

    config = v41_config(RELEASE_LIKE_V41_TEXT)
    write_v41_checkpoint(tmp_path / "src", config, seed=11)
    text = torch.randint(2, 700, (1, PROMPT), generator=torch.Generator().manual_seed(11))
    shipped = lm_v41._fake_quant_fp8
    off = MlxLmDeepseekV41(tmp_path / "src")(text)
    assert lm_v41._fake_quant_fp8 is shipped
    on = MlxLmDeepseekV41(tmp_path / "src", rounding=True)(text)
    assert mean_kld(off, on) > 1e-4


# Roles across layers, as both references keep their state ("the last one written", read by position): layer 3 is a
# second key owner indexing inside the candidate source 2's blocks (the keys it scores are 3's, the blocks 2's),
# layer 4 an indexer scoring 3's keys under 2's blocks, layer 5 a KV source attending to its own entries through 4's
# choice (scored on 3's keys). The engine refused all three before ("indexer 3 scores other keys than the candidate
# source 2", 34 of 70 random draws); the references run them, so it runs them as they do.
CROSSED_ROLES = {**RELEASE_LIKE_V41_TEXT, "num_hidden_layers": 6, "compress_ratios": [0, 0, 1, 1, 1, 1],
                 "kv_source_layer_ids": [2, 3, 5], "index_source_layer_ids": [2, 3, 4], "candidate_source_layer_id": 2,
                 "candidate_topk_blocks": 2, "candidate_block_size": 4, "index_topk": 4}


def test_roles_read_across_layers_as_both_mlx_references_read_them(tmp_path):
    from engine.model import Model
    from kconvert.verify.mlx_reference import MlxDeepseekV41, MlxLmDeepseekV41

    config = v41_config(CROSSED_ROLES)
    write_v41_checkpoint(tmp_path / "src", config, seed=5)
    r = cli_here("shard", tmp_path / "src", tmp_path / "tp1", "--tp", 1, "--quant", "none")
    assert r.returncode == 0, r.stderr
    text = torch.randint(2, 700, (1, PROMPT), generator=torch.Generator().manual_seed(5))
    with one_thread():
        engine = Model.from_converted(tmp_path / "tp1", dtype=torch.float32).forward(text).float()
    vlm = MlxDeepseekV41(tmp_path / "src", torch.float32)(text).logits
    lm = MlxLmDeepseekV41(tmp_path / "src")(text)
    assert mean_kld(vlm, lm) < 1e-8, "the two MLX references disagree: not the engine's difference to judge"
    assert mean_kld(vlm, engine) < 1e-5 and mean_kld(lm, engine) < 1e-5, (mean_kld(vlm, engine), mean_kld(lm, engine))
    # across a pipeline boundary after layer 2: the next stage reads 2's entries, keys and candidate blocks
    r = cli_here("shard", tmp_path / "src", tmp_path / "pp2", "--tp", 1, "--pp", 2, "--pp-layers", "0-2,3-5")
    assert r.returncode == 0, r.stderr
    r = cli_here("reference", tmp_path / "src", "--out", tmp_path / "ref.safetensors", "--prompts", "default")
    assert r.returncode == 0, r.stderr
    r, rep = verify_json(tmp_path / "pp2", tmp_path / "ref.safetensors")
    assert r.returncode == 0 and rep["cost"]["overall"]["mean_kld"] < 1e-5, (r.stderr, rep and rep["cost"]["overall"])
