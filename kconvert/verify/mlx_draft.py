"""The MLX reference of DeepSeek-V4's MTP block (verify's draft check, kconvert/verify/draft.py): mlx-vlm 0.7.10's
own `deepseek_v4_mtp` drafter, loaded strictly from the source's `mtp.{M}.*` tensors through its own `sanitize`,
with the source's embeddings and head, on MLX's CPU backend in float32. It reads the target's residual streams
after the last layer and the next tokens, as the engine's head does (engine/models/deepseek_v4/mtp.py; tests/
test_draft_heads.py checks the two agree on a config that is no preset)."""

from __future__ import annotations

import json
from pathlib import Path

import torch


class V4MtpReference:
    def __init__(self, root: Path, layer: int):
        import mlx.core as mx
        from mlx_vlm.speculative.drafters.deepseek_v4_mtp import DeepseekV4MTPDraftModel, ModelConfig

        self.mx = mx
        from engine.draft.registry import own_prefix, shared_tensor_name
        from kconvert.family.manifest import bind

        config = json.loads((Path(root) / "config.json").read_text())
        mm = bind(config)
        cfg = mm.text_config
        n = cfg["num_hidden_layers"]
        # its block is sliding only; mlx-vlm's config accepts only the released rates (0 / 4 / 128) in the schedule
        self.model = DeepseekV4MTPDraftModel(ModelConfig.from_dict({"text_config": {**cfg, "compress_ratios": [0] * n}}))
        own = own_prefix(mm, layer)  # the block's stored prefix (mtp.0., or Kimi's language_model.model.mtp.0.)
        shared = {shared_tensor_name(mm, c): c for c in ("embed", "head")}
        weights, self.shared = {}, {}
        for f in sorted(Path(root).glob("*.safetensors")):
            for k, v in mx.load(str(f)).items():
                if k.startswith(own):
                    weights[f"mtp.{layer - n}." + k[len(own):]] = v
                elif k in shared:
                    self.shared[shared[k]] = v.astype(mx.float32)
        self.embed, self.head = self.shared["embed"], self.shared.get("head", self.shared["embed"])
        self.model.load_weights(list(self.model.sanitize(weights).items()), strict=True)
        self.model.set_dtype(mx.float32)

    def logprobs(self, streams: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """[S, V] log-probs of the head at every position: streams [1,S,hc,H] (the target's), next_ids [1,S]."""
        import numpy as np

        mx = self.mx
        ids = mx.array(next_ids.to(torch.int64).numpy())
        normed, _ = self.model._forward_hidden(self.embed[ids], mx.array(streams.float().numpy()), ids, None)
        logits = normed @ self.head.T
        mx.eval(logits)
        return torch.from_numpy(np.array(logits[0])).float().log_softmax(-1)
