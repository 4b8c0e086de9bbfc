"""The MLX reference of DeepSeek-V4's DSpark drafter (V4-Flash-0731 layout, mtp.0..N): mlx-vlm 0.7.10's own
`deepseek_v4_dspark` drafter (DeepseekV4DsparkDraftModel), loaded strictly from the source's `mtp.*` tensors through
its own `sanitize`, configured as its own splitter configures it (`DeepseekV4DsparkSplitter.extra_config`: target
layers, noise token, Markov rank, block size; the stage count from the stored stages, as its `split` counts them),
with the source's embeddings and head bound, on MLX's CPU backend in float32. A quantized source (FP8 / FP4) is read
through kconvert's exact dequantization (verify/fake_quant.write_dequantized_source): mlx-vlm reads plain weights.

Its input is what its round loop feeds it: the target's hidden states at `dspark_target_layer_ids` (each the
residual after that decoder layer, averaged over its hc copies, concatenated in the list's order), one position per
call through the drafter's own context cache (a sliding window of `sliding_window` positions), and a block of
`dspark_block_size` tokens: the last token known, then the noise token."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import torch

from kconvert.io.side_files import MAX_CONFIG, read_json


class V4DsparkReference:
    def __init__(self, root: Path):
        import mlx.core as mx
        import mlx.nn as nn
        from mlx_vlm.speculative.drafters.deepseek_v4_dspark import DeepseekV4DsparkDraftModel, ModelConfig
        from mlx_vlm.speculative.drafters.deepseek_v4_dspark.split import DeepseekV4DsparkSplitter

        from engine.draft.registry import shared_tensor_name
        from kconvert.family.manifest import bind

        self.mx = mx
        root = Path(root)
        config = read_json(root / "config.json", limit=MAX_CONFIG)
        with tempfile.TemporaryDirectory(prefix="kconvert-dspark-") as tmp:
            if config.get("quantization_config"):  # mlx-vlm reads plain weights: the release's exact dequantization
                from kconvert.verify.fake_quant import write_dequantized_source

                root = write_dequantized_source(str(root), Path(tmp) / "dequantized")
            loaded = {}
            for f in sorted(root.glob("*.safetensors")):
                loaded.update(mx.load(str(f)))
            mx.eval(list(loaded.values()))  # read now: the dequantized copy goes with the directory
        mm = bind(config)
        shared = {shared_tensor_name(mm, c): c for c in ("embed", "head")}
        weights = {k: v for k, v in loaded.items() if k.startswith("mtp.")}
        stages = {int(m[1]) for k in weights if (m := re.match(r"mtp\.(\d+)\.", k))}
        cfg = mm.text_config
        splitter = DeepseekV4DsparkSplitter()
        splitter._n_mtp_layers = max(stages) + 1  # as its split() counts them: the config undercounts (0731: 1)
        # its blocks are sliding only; mlx-vlm's V4 config accepts only the released rates (0 / 4 / 128)
        text = {**cfg, "compress_ratios": [0] * cfg["num_hidden_layers"]}
        self.config = ModelConfig.from_dict({"text_config": text, **splitter.extra_config(cfg)})
        self.model = DeepseekV4DsparkDraftModel(self.config)
        self.model.load_weights(list(self.model.sanitize(weights).items()), strict=True)
        self.model.set_dtype(mx.float32)
        embed = loaded[next(k for k, c in shared.items() if c == "embed")].astype(mx.float32)
        head_name = next((k for k, c in shared.items() if c == "head" and k in loaded), None)
        head = loaded[head_name].astype(mx.float32) if head_name else embed

        class Target(nn.Module):  # what its bind() looks for: embed_tokens and lm_head
            def __init__(self):
                super().__init__()
                self.embed_tokens = nn.Embedding(*embed.shape)
                self.embed_tokens.weight = embed
                self.lm_head = nn.Linear(head.shape[1], head.shape[0], bias=False)
                self.lm_head.weight = head

        self.target = Target()
        self.noise = int(self.config.mask_token_id)
        self.block = int(self.config.proposal_length)  # dspark_block_size: the anchor and block - 1 noise tokens

    def _run(self, taps: torch.Tensor, tokens: torch.Tensor):
        """The block's logits before the Markov bias at every position, [S, block, V] (MLX)."""
        import numpy as np

        mx = self.mx
        cache = self.model.reset(self.target)
        h = mx.array(taps.float().numpy())
        ids = tokens.to(torch.int64).reshape(-1).tolist()
        rows = []
        for i, anchor in enumerate(ids):
            block = mx.array([[anchor] + [self.noise] * (self.block - 1)], dtype=mx.int32)
            logits = self.model._logits(self.model._hidden(block, h[:, i:i + 1], cache))
            mx.eval(logits)
            rows.append(logits[0])
        return mx.stack(rows), np

    def logprobs(self, taps: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """[S, V] log-probs of the first draft at every position: taps [1, S, n_targets * hidden] (context
        taps[:, :i+1] at position i), tokens [1, S] (tokens[0, i]: the token after position i, the block's anchor);
        the block's first logits plus the Markov bias of tokens[i] (VanillaMarkov.apply_step_logits)."""
        mx = self.mx
        logits, np = self._run(taps, tokens)
        prev = mx.array(tokens.to(torch.int64).reshape(-1).numpy().astype("int32"))
        out = self.model.markov_head.apply_step_logits(logits[:, 0], prev)
        mx.eval(out)
        return torch.from_numpy(np.array(out)).float().log_softmax(-1)

    def block_logprobs(self, taps: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """[S, dspark_block_size, V]: every block position k at position i, its logits plus the Markov bias of the
        true previous token tokens[i + k]; past the last token (i + k > S - 1) the noise token's row stands in
        (no true token is known there)."""
        mx = self.mx
        logits, np = self._run(taps, tokens)
        ids = tokens.to(torch.int64).reshape(-1).tolist()
        S = len(ids)
        prev = [[ids[i + k] if i + k < S else self.noise for k in range(self.block)] for i in range(S)]
        out = self.model.markov_head.apply_step_logits(logits, mx.array(prev, dtype=mx.int32))
        mx.eval(out)
        return torch.from_numpy(np.array(out)).float().log_softmax(-1)
