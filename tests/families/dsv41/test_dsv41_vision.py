"""DeepSeek-V4.1's vision side against mlx-vlm 0.7.10's deepseek_v41 (its ViT, Aligner, merge_image_embeddings,
image_token_types and image processor), on the tiny preset's vision tower and on one that is not the preset
(3 blocks 96 wide, 8-pixel patches, 3 x 3 windows, other resize rules): the engine's image spans equal mlx-vlm's
on the same patches (partial windows included), their layout is mlx-vlm's, the preprocessing gives mlx-vlm's
pixels and grids, `kconvert reference` + `verify` pass on the built-in image prompts, the chat's image turn
answers what the reference predicts, and a damaged vision tensor fails verify on the image positions."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from helpers import assert_one_line_error, cli_here, one_thread
from kconvert.fixtures.models.dsv41 import v41_config, write_v41_checkpoint

OTHER_VISION = {"num_hidden_layers": 3, "hidden_size": 96, "num_attention_heads": 2, "intermediate_size": 80,
                "patch_size": 8, "rope_theta": 5000.0, "downsample_ratio": 3, "min_pixels": 6000,
                "max_image_tokens": 16, "max_wh_ratio": 2.5}
ALIGNER_W1 = "aligner.w1.weight"


@pytest.fixture(scope="module")
def v41(tmp_path_factory):
    """The preset and the non-preset vision tower over the tiny V4.1 text model: sources, tp 1 conversions, and
    the reference of the non-preset one."""
    d = tmp_path_factory.mktemp("v41vision")
    for name, vision in (("preset", None), ("other", OTHER_VISION)):
        write_v41_checkpoint(d / name, v41_config(vision_overrides=vision), seed=5)
        r = cli_here("shard", d / name, d / f"{name}-tp1", "--tp", 1, "--quant", "none")
        assert r.returncode == 0, r.stderr
    with one_thread():
        r = cli_here("reference", d / "other", "--out", d / "ref.safetensors")
    assert r.returncode == 0, r.stderr
    return d


@pytest.fixture(scope="module")
def sides(v41):
    """{config name: (engine model, mlx-vlm reference, config.json)}."""
    from engine.model import Model
    from kconvert.verify.mlx_reference import MlxDeepseekV41

    return {name: (Model.from_converted(v41 / f"{name}-tp1", dtype=torch.float32),
                   MlxDeepseekV41(v41 / name, torch.float32), json.loads((v41 / name / "config.json").read_text()))
            for name in ("preset", "other")}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("name", ["preset", "other"])
def test_the_engines_image_spans_are_mlx_vlms(sides, name):
    """Tower + aligner + span on the same patches: each image alone and several in one call, on grids whose
    windows are whole and grids with a partial r x r window at the bottom and right (zero-filled)."""
    model, ref, config = sides[name]
    p, r = config["vision_config"]["patch_size"], config["vision_config"]["downsample_ratio"]
    gen = torch.Generator().manual_seed(11)
    grids = [(2 * r, 3 * r), (2 * r + 1, 3 * r - 1), (r - 1, 1), (5, 7)]
    patches = [torch.randn(h * w, 3, p, p, generator=gen) for h, w in grids]
    theirs = []
    for (h, w), x in zip(grids, patches):
        want = ref.image_features(x, torch.tensor([[1, h, w]]))
        assert want.shape[0] == model.tokens_per_image((h, w)) == math.ceil(h / r) * (math.ceil(w / r) + 1) + 2
        assert rel_err(model.vision(x, [(h, w)]), want) < 1e-5
        theirs.append(want)
    assert rel_err(model.vision(torch.cat(patches), grids), torch.cat(theirs)) < 1e-5


def test_the_span_layout_is_mlx_vlms_image_token_types(sides):
    """Start, each row of windows then a row break, end: the rows at mlx-vlm's IMAGE_START / IMAGE_NEW_LINE /
    IMAGE_END types are the learned vectors, and the IMAGE rows are mlx-vlm's aligner rows in reading order."""
    import mlx.core as mx
    import numpy as np
    from mlx_vlm.models.deepseek_v41.processing_deepseek_v41 import (IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_START,
                                                                     image_token_types)

    model, ref, config = sides["other"]
    p, r = config["vision_config"]["patch_size"], config["vision_config"]["downsample_ratio"]
    proj = model.mm_projector
    marks = {IMAGE_START: proj.image_start, IMAGE_NEW_LINE: proj.image_newline, IMAGE_END: proj.image_end}
    for h, w in [(1, 1), (3, 3), (4, 7), (8, 2)]:
        x = torch.randn(h * w, 3, p, p, generator=torch.Generator().manual_seed(h * 10 + w))
        span = model.vision(x, [(h, w)])
        types = torch.tensor(image_token_types(math.ceil(h / r), math.ceil(w / r)))
        assert span.shape[0] == len(types)
        for code, vector in marks.items():
            assert torch.equal(span[types == code], vector.float().expand(int((types == code).sum()), -1))
        aligned = ref.model.encode_image(mx.array(x.numpy()), h, w)
        assert rel_err(span[types == IMAGE], torch.from_numpy(np.array(aligned))) < 1e-5


def test_mlx_vlms_tanh_gelu_is_the_only_difference_from_its_own_aligner(sides):
    """The reference swaps mlx-vlm's Aligner activation (`approx="precise"`, MLX's tanh approximation) for the exact
    GELU of DeepSeek's code. With mlx-vlm's own activation the spans differ by that approximation alone: well above
    the engine's round-off, and gone with the swap."""
    import mlx.nn as nn

    model, ref, config = sides["preset"]
    p = config["vision_config"]["patch_size"]
    x = torch.randn(6 * 4, 3, p, p, generator=torch.Generator().manual_seed(3))
    grid = torch.tensor([[1, 6, 4]])
    exact = ref.image_features(x, grid)
    ref.model.aligner.act = nn.GELU(approx="precise")
    try:
        approximate = ref.image_features(x, grid)
    finally:
        ref.model.aligner.act = nn.GELU()
    ours = model.vision(x, [(6, 4)])
    assert rel_err(ours, exact) < 1e-6 < 1e-5 < rel_err(ours, approximate)


def _mlx_config(config: dict):
    from mlx_vlm.models.deepseek_v41.config import ModelConfig

    return ModelConfig.from_dict(config)


@pytest.mark.parametrize("name", ["preset", "other"])
def test_resize_plans_are_mlx_vlms(sides, name):
    """Enlarged below min_pixels, clamped past max_wh_ratio, shrunk to the token budget (one column for a very
    tall image, one row for a very wide one): the same pixel size and window grid as mlx-vlm's plan_image_grid."""
    from mlx_vlm.models.deepseek_v41.processing_deepseek_v41 import plan_image_grid

    from engine.models.deepseek_v41.image import DeepseekImageRules, plan

    model, _, config = sides[name]
    rules, mc = DeepseekImageRules.of(model.mc.vision), _mlx_config(config)
    sizes = [(w, h) for w in (1, 5, 13, 28, 57, 84, 100, 333, 1000, 4000) for h in (1, 7, 28, 56, 90, 250, 999, 3000)]
    for w, h in sizes:
        assert plan(w, h, rules) == plan_image_grid(w, h, mc), (w, h)


@pytest.mark.parametrize("name", ["preset", "other"])
def test_preprocessing_gives_mlx_vlms_patches(sides, name, tmp_path):
    """Pillow-built pictures (padded on grey, enlarged, shrunk to the budget, stretched past max_wh_ratio) through
    the family's processor (chosen by the manifest's image_processor, as chat and verify do, a path as chat reads
    it): mlx-vlm's processor's patches and grid, and a span as long as mlx-vlm reserves for it."""
    import numpy as np
    from mlx_vlm.models.deepseek_v41.processing_deepseek_v41 import load_image, num_image_tokens
    from PIL import Image

    from engine.inputs.image import preprocess_for
    from kconvert.verify.prompts import synthetic_image

    model, _, config = sides[name]
    mc = _mlx_config(config)
    gen = torch.Generator().manual_seed(7)
    noise = Image.frombytes("RGB", (70, 45), bytes(torch.randint(0, 256, (70 * 45 * 3,), generator=gen,
                                                                 dtype=torch.uint8).tolist()))
    pictures = [synthetic_image(1, 84, 56), synthetic_image(2, 60, 90), synthetic_image(3, 20, 12),
                synthetic_image(4, 400, 300), synthetic_image(5, 300, 40), synthetic_image(6, 30, 500), noise]
    for i, im in enumerate(pictures):
        path = tmp_path / f"{i}.png"
        im.save(path)
        patches, grid = preprocess_for(model.mc.vision, path)
        want, n_h, n_w, llm_h, llm_w = load_image(im, mc)
        assert grid == (n_h, n_w), im.size
        assert torch.equal(patches, torch.from_numpy(np.array(want))), im.size
        assert model.tokens_per_image(grid) == num_image_tokens(llm_h, llm_w)


def test_reference_and_verify_pass_on_image_prompts(v41):
    """`kconvert reference` (mlx-vlm's model, its ViT / Aligner / span merge on the same patches) and `verify` of
    the tp 1 conversion on the built-in prompts, two of them images (one with partial windows)."""
    with one_thread():
        r = cli_here("verify", v41 / "other-tp1", "--reference", v41 / "ref.safetensors", "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["verdict"] == "PASS", rep
    image = rep["cost"]["by_kind"]["image"]
    assert image["positions"] > 0 and image["mean_kld"] < 1e-5, image
    assert rep["cost"]["overall"]["mean_kld"] < 1e-5


def test_a_damaged_vision_tensor_fails_verify_on_the_image_positions(v41, tmp_path):
    """Two neighbours of one window swapped in the aligner's input (columns of aligner.w1, as a wrong window order
    would read them): the text prompts stay exact, the image prompts fail."""
    from kconvert.verify import damage

    out = tmp_path / "damaged"
    shutil.copytree(v41 / "other-tp1", out)

    def swap(t):
        w = t[ALIGNER_W1].clone()
        w[:, [0, 1]] = w[:, [1, 0]]
        t[ALIGNER_W1] = w

    for rel in damage.files_holding(out, ALIGNER_W1):
        damage.rewrite(out, rel, swap)
    with one_thread():
        r = cli_here("verify", out, "--reference", v41 / "ref.safetensors", "--json")
    rep = json.loads(r.stdout)
    assert r.returncode != 0 and rep["verdict"] == "FAIL", rep
    assert rep["cost"]["by_kind"]["image"]["mean_kld"] > 1e-3
    assert rep["cost"]["by_kind"]["short"]["mean_kld"] < 1e-5


def test_chat_answers_an_image_turn_as_the_reference_predicts(sides, v41, tmp_path, monkeypatch):
    """engine.chat's image turn (the family's processor, the span's length, the placeholder expanded, the span's
    rows scattered in): its first greedy token is the reference's top token on the same prompt and pixels."""
    import io

    from engine.chat import session as chat_session
    from engine.inputs.image import preprocess_for
    from engine.inputs.tokenizer import Tokenizer
    from engine.runtime.generate import Sampling
    from kconvert.verify.prompts import synthetic_image

    model, ref, _ = sides["other"]
    path = tmp_path / "picture.png"
    synthetic_image(9, 90, 70).save(path)
    seen = {}

    def generate(model, prompt, *args, **kwargs):
        seen["prompt"], seen["result"] = prompt, chat_session.generate_greedy(model, prompt, *args, **kwargs)
        return seen["result"]

    monkeypatch.setattr(chat_session, "generate_greedy", chat_session.generate, raising=False)
    monkeypatch.setattr(chat_session, "generate", generate)
    tok = Tokenizer(v41 / "other-tp1")
    with one_thread():
        chat = chat_session.Session(model, tok, Sampling(max_new_tokens=1), None, 512)
        chat.turn("What is this?", str(path), io.StringIO())
    patches, grid = preprocess_for(model.mc.vision, path)
    prompt = seen["prompt"]
    assert prompt.count(model.mc.vision.image_token_id) == model.tokens_per_image(grid)
    logits = ref(torch.tensor([prompt]), pixel_values=patches, image_grid_thw=torch.tensor([[1, *grid]])).logits
    assert seen["result"].tokens[0] == int(logits[0, -1].argmax())


@pytest.mark.parametrize("change,needle", [
    ({"downsample_ratio": 0}, "vision_config.downsample_ratio = 0: outside [1, 64]"),
    ({"max_image_tokens": 3}, "vision_config.max_image_tokens = 3: outside"),
    ({"num_attention_heads": 5}, "hidden_size // num_attention_heads % 4 == 0"),
])
def test_a_bad_vision_config_is_one_line_naming_the_field(v41, tmp_path, change, needle):
    src = tmp_path / "src"
    shutil.copytree(v41 / "other", src)
    config = json.loads((src / "config.json").read_text())
    config["vision_config"].update(change)
    (src / "config.json").write_text(json.dumps(config))
    r = cli_here("inspect", src)
    assert_one_line_error(r, "config.json", needle)
