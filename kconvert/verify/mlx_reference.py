"""The MLX reference (a family whose manifest says `reference_backend = "mlx"`, its class here named by
`reference_class`): Apple's MLX on its Linux CPU backend runs the MLX projects' own model of the family, loaded from
the source checkpoint as released (their `sanitize` reads the released names and quantized storage; a strict load
refuses any tensor they do not know). No transformers release runs Kimi K3 or DeepSeek-V4.1, so these are the
independent implementations verify compares against: mlx-lm's kimi_k3 (MlxReference) and mlx-vlm's deepseek_v41
(MlxDeepseekV41, below: its activation fake-quantization off).

`MlxReference(ck, dtype)` answers as a transformers model does for reference.py: `model(input_ids=[1, T],
output_hidden_states=...)` -> `.logits` [1, T, V] and `.hidden_states`: the embeddings, the residual after
each layer (with block attention residuals: the running partial sum, what the engine reports too), and the
final norm's output. The layers run under mlx-lm's own classes; only the loop over them is here, so the
states between layers can be read (tests/families/kimi_k3/test_kimi_k3.py checks the loop gives the model's own logits). Image
prompts: mlx-vlm's Kimi K3 vision tower and patchmergerv2 projector (its own classes, strictly loaded from the
checkpoint) on the patches verify's prompt set preprocesses (kconvert/verify/prompts.py): the same pixels reach
both sides, so the towers, projectors and text models are compared, not the two image processors. DeepSeek-V4.1:
mlx-vlm's ViT, Aligner (with the exact GELU, `exact_gelu`) and merge_image_embeddings make the whole image span
from those patches, its token types by mlx-vlm's image_token_types (tests/families/dsv41/test_dsv41_vision.py compares mlx-vlm's
own processor with kconvert's separately).""" 

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kconvert.errors import UsageError
from kconvert.io.side_files import MAX_CONFIG, read_json



def _mlx():
    """mlx.core and mlx-lm's loader; a missing one is the CLI's one-line install command (kconvert/deps.py: the
    `mlx` extra's pins, what the reference was checked with)."""
    import mlx.core as mx
    from mlx_lm.utils import load_model

    return mx, load_model


@dataclass
class Output:
    logits: torch.Tensor
    hidden_states: tuple[torch.Tensor, ...] | None


class MlxReference:
    """mlx-lm's model of a checkpoint directory, in float32 / bfloat16 / float64."""

    def __init__(self, root: Path, dtype: torch.dtype):
        mx, load_model = _mlx()
        self.mx, self.root = mx, Path(root)
        self.model, _ = load_model(self.root, strict=True)
        self.dtype = {torch.float32: mx.float32, torch.bfloat16: mx.bfloat16, torch.float64: mx.float64}[dtype]
        self.model.set_dtype(self.dtype)  # floating weights only: packed MXFP4 codes and their scales stay
        self.torch_dtype = dtype
        self._vision = None

    def _vision_modules(self):
        """mlx-vlm's Kimi K3 vision tower and projector, strictly loaded from the checkpoint's own tensors."""
        if self._vision is None:
            from mlx_vlm.models.kimi_k3.config import ModelConfig, TextConfig, VisionConfig
            from mlx_vlm.models.kimi_k3.kimi_k3 import KimiK3MultiModalProjector
            from mlx_vlm.models.kimi_k3.vision import VisionModel

            mx = self.mx
            cfg = read_json(self.root / "config.json", limit=MAX_CONFIG)
            mc = ModelConfig.from_dict(cfg)
            mc.text_config, mc.vision_config = TextConfig.from_dict(cfg["text_config"]), VisionConfig.from_dict(cfg["vision_config"])
            tower, projector = VisionModel(mc.vision_config), KimiK3MultiModalProjector(mc)
            weights = {}
            for f in sorted(self.root.glob("*.safetensors")):
                weights.update({k: v for k, v in mx.load(str(f)).items() if k.startswith(("vision_tower.", "mm_projector."))})
            weights = tower.sanitize(weights)  # the patch conv into MLX's channels-last layout
            tower.load_weights([(k[len("vision_tower."):], v) for k, v in weights.items() if k.startswith("vision_tower.")])
            projector.load_weights([(k[len("mm_projector."):], v) for k, v in weights.items() if k.startswith("mm_projector.")])
            tower.set_dtype(self.dtype)
            projector.set_dtype(self.dtype)
            self._vision = tower, projector
        return self._vision

    def image_features(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """[merged tokens, text hidden]: mlx-vlm's tower and projector on the same patches the engine gets."""
        tower, projector = self._vision_modules()
        pixels = self.mx.array(pixel_values.float().numpy()).astype(self.dtype).transpose(0, 2, 3, 1)  # NHWC
        feats = projector(tower(pixels, grid_thws=grid_thw.tolist()))
        self.mx.eval(feats)
        return self._to_torch(feats)

    def eval(self) -> "MlxReference":
        return self

    def _to_torch(self, a) -> torch.Tensor:
        import numpy as np

        return torch.from_numpy(np.array(a.astype(self.mx.float32 if self.dtype != self.mx.float64 else self.dtype)))

    def __call__(self, input_ids: torch.Tensor, output_hidden_states: bool = False, pixel_values=None,
                 image_grid_thw=None, image_token_id: int | None = None, **kwargs) -> Output:
        from mlx_lm.models.base import create_attention_mask
        from mlx_lm.models.kimi_k3 import ResidualBlocks, _attn_res_mix

        mx = self.mx
        lm = self.model.language_model
        tm = lm.model
        ids = mx.array(input_ids.numpy())
        h = tm.embed_tokens(ids)
        if pixel_values is not None:  # the image's features replace its placeholder tokens
            import numpy as np

            feats = mx.array(self.image_features(pixel_values, image_grid_thw).numpy()).astype(h.dtype)
            where = np.nonzero(np.array(ids[0] == image_token_id))[0]
            if len(where) != feats.shape[0]:
                raise UsageError(f"{len(where)} image placeholders for {feats.shape[0]} image features")
            h[0, mx.array(where)] = feats
        mask = create_attention_mask(h, None, return_array=True)
        blocks = ResidualBlocks(tm.args.rms_norm_eps) if tm.use_attn_res else None
        states = []
        for layer in tm.layers:
            states.append(h)
            h, blocks = layer(h, mask=None if layer.is_linear else mask, cache=None, blocks=blocks)
        if blocks is not None:
            w = tm.output_attn_res_norm.weight.astype(mx.float32) * tm.output_attn_res_proj.weight.reshape(-1)
            h = _attn_res_mix(blocks, h, w, tm.args.rms_norm_eps, False)
        out = tm.norm(h)
        states.append(out)
        logits = lm.lm_head(out) if lm.lm_head is not None else tm.embed_tokens.as_linear(out)
        mx.eval(logits, *states)
        hidden = tuple(self._to_torch(s) for s in states) if output_hidden_states else None
        return Output(self._to_torch(logits), hidden)


def exact_gelu():
    """MLX's exact (erf) GELU module. mlx-vlm 0.7.10's deepseek_v41 Aligner asks for `nn.GELU(approx="precise")`,
    which MLX maps to its tanh approximation (nn.gelu_approx), not the erf GELU of DeepSeek's own vision code (torch's
    F.gelu; mlx-vlm's V4 vision Aligner uses the exact one too): the reference runs the Aligner with the exact GELU,
    as the engine does (tests/families/dsv41/test_dsv41_vision.py measures the gap the approximation alone makes)."""
    import mlx.nn as nn

    return nn.GELU()


class MlxDeepseekV41(MlxReference):
    """mlx-vlm 0.7.10's DeepSeek-V4.1 (text, vision tower and Engram; mlx-lm's deepseek_v41 refuses Engram layers),
    strictly loaded from the release's FP8 / FP4 storage (its sanitize dequantizes them exactly, as kconvert does).

    Convention: the reference's QAT fake-quantization (it rounds linear inputs and the window KV to FP8 and the
    compressed KV and indexer queries / keys to FP4, as DeepSeek's kernels do; mlx-lm rounds no linear input but
    the same KV, queries and keys: MlxLmDeepseekV41 below) is switched off (`fakequant.DISABLE`): verify measures what a conversion changes in the weights, and
    the activation rounding (mean KLD ~1e-2 between the two MLX models until it is off in both) would bury that
    below its own noise. kconvert's engine does not round activations either (its KV formats are opt-in)."""

    def __init__(self, root: Path, dtype: torch.dtype):
        import mlx.core as mx
        from mlx_vlm.models.deepseek_v41 import fakequant
        from mlx_vlm.models.deepseek_v41.config import ModelConfig
        from mlx_vlm.models.deepseek_v41.deepseek_v41 import Model

        self.mx, self.root, self.torch_dtype = mx, Path(root), dtype
        fakequant.DISABLE = True
        self.model = Model(ModelConfig.from_dict(read_json(self.root / "config.json", limit=MAX_CONFIG)))
        self.model.aligner.act = exact_gelu()
        weights = {}
        for f in sorted(self.root.glob("*.safetensors")):
            weights.update(mx.load(str(f)))
        self.model.load_weights(list(self.model.sanitize(weights).items()), strict=True)
        self.model.model_path = self.root  # its Engram hashes read engram_token_map.json there
        self.dtype = {torch.float32: mx.float32, torch.bfloat16: mx.bfloat16, torch.float64: mx.float64}[dtype]
        self.model.set_dtype(self.dtype)
        self._vision = None

    def _image_input(self, start: int, pixel_values: torch.Tensor, grid_thw: torch.Tensor):
        """mlx-vlm's record of one image (its processor's ImageInput) for the patches the engine gets: the span's
        token types from mlx-vlm's own layout rule over the aligner's window grid."""
        import math

        from mlx_vlm.models.deepseek_v41.processing_deepseek_v41 import ImageInput, image_token_types

        grids = grid_thw.tolist()
        if len(grids) != 1 or grids[0][0] != 1:
            raise UsageError(f"the DeepSeek-V4.1 reference takes one image per prompt, got grids {grids}")
        _, h, w = grids[0]
        r = self.model.config.vision_downsample_ratio
        patches = self.mx.array(pixel_values.float().numpy()).astype(self.dtype)
        return ImageInput(start, patches, h, w, image_token_types(math.ceil(h / r), math.ceil(w / r)))

    def image_features(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """[span, text hidden]: one image's whole span (start, aligner rows with a row break after each row of
        windows, end) as mlx-vlm's ViT, Aligner and merge_image_embeddings make it from the engine's patches."""
        img = self._image_input(0, pixel_values, grid_thw)
        blank = self.mx.zeros((1, len(img.types), self.model.config.hidden_size), dtype=self.dtype)
        span = self.model.merge_image_embeddings([[img]], blank)[0]
        self.mx.eval(span)
        return self._to_torch(span)

    def _merge_image(self, input_ids: torch.Tensor, h, pixel_values, grid_thw, image_token_id):
        """The embeddings h with the image's span merged in by mlx-vlm; the span must be exactly the run of image
        tokens the prompt holds (one image per prompt)."""
        config_id = self.model.config.image_token_id
        if image_token_id is not None and image_token_id != config_id:
            raise UsageError(f"image token {image_token_id} is not the reference config's {config_id}")
        where = (input_ids[0] == config_id).nonzero().flatten().tolist()
        img = self._image_input(where[0] if where else 0, pixel_values, grid_thw)
        if where != list(range(img.start, img.start + len(img.types))):
            raise UsageError(f"{len(where)} image tokens in the prompt for an image span of {len(img.types)}")
        return self.model.merge_image_embeddings([[img]], h)

    def __call__(self, input_ids: torch.Tensor, output_hidden_states: bool = False, pixel_values=None,
                 image_grid_thw=None, image_token_id: int | None = None, **kwargs) -> Output:
        from mlx_vlm.models.deepseek_v41.language import DeepseekV41Block, DeepseekV41Cache, make_identity_pre_mix

        mx = self.mx
        lm = self.model.language_model
        ids = mx.array(input_ids.numpy())
        B, S = ids.shape
        image = ids == lm.config.image_token_id
        live = ~image
        cache = DeepseekV41Cache(len(lm.layers))
        h = lm.embed_tokens(ids)
        if pixel_values is not None:
            h = self._merge_image(input_ids, h, pixel_values, image_grid_thw, image_token_id)
        streams = mx.broadcast_to(h[..., None, :], (B, S, lm.config.hc_mult, lm.config.hidden_size))
        lm._ensure_engram_hash()
        hashes = None if lm.engram_hash is None else lm.engram_hash(ids, 0, cache, token_mask=live)
        pre_mix = make_identity_pre_mix(B, S, lm.config.hc_mult)
        states = []
        for layer in lm.layers:
            states.append(streams)  # the input of the layer, before its Engram (what the engine reports too)
            if layer.engram is not None and hashes is not None:
                streams = layer.engram(streams, hashes[:, :, layer.engram.layer_hash_index, :], live)
            streams, pre_mix = layer(streams, pre_mix, image, cache)
        out = lm.norm(DeepseekV41Block.hc_pre(streams, pre_mix))
        states.append(out)
        logits = lm.head(out)
        mx.eval(logits, *states)
        hidden = tuple(self._to_torch(s) for s in states) if output_hidden_states else None
        return Output(self._to_torch(logits), hidden)


class MlxLmDeepseekV41:
    """mlx-lm 0.32.2's deepseek_v41 (text only: it refuses Engram layers), strictly loaded from the release's storage,
    as a second reference for V4.1 (tests/families/dsv41/test_dsv41_forward.py, bench/v41_references.py). It rounds the window KV
    to FP8 and the compressed KV and the indexer's queries / keys to FP4 on every forward, with no switch; with
    `rounding=False` those module functions are identity while it runs, which is what mlx-vlm's `fakequant.DISABLE`
    gives the other reference: then both equal unrounded math. `self(ids [1, T])` -> float32 logits [1, T, V]."""

    def __init__(self, root: Path, dtype: torch.dtype = torch.float32, rounding: bool = False):
        mx, load_model = _mlx()
        self.mx, self.rounding = mx, rounding
        self.model, _ = load_model(Path(root), strict=True)
        self.model.set_dtype({torch.float32: mx.float32, torch.bfloat16: mx.bfloat16}[dtype])

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        import mlx_lm.models.deepseek_v41 as lm_v41
        import numpy as np

        names = ("_fake_quant_fp8", "_fake_quant_fp4")
        kept = {n: getattr(lm_v41, n) for n in names}
        if not self.rounding:
            for n in names:
                setattr(lm_v41, n, lambda x, *args, **kwargs: x)
        try:
            logits = self.model(self.mx.array(input_ids.numpy())).astype(self.mx.float32)
            self.mx.eval(logits)
        finally:
            for n, f in kept.items():
                setattr(lm_v41, n, f)
        return torch.from_numpy(np.array(logits))
