"""Tiny DeepSeek-V4 references for the engine's V4 layers: transformers 5.23's DeepseekV4ForCausalLM with seeded
random weights (float32), and its state dict in the engine's layout (routed experts one module each)."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace

import torch

from engine.config import _text

CSA, HCA, SLIDING = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
YARN = {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1}

# Two shapes that are no preset: compressed branches and the indexer's top-k reached within ~40 tokens.
CONFIGS = {
    # transformers' own spelling (layer_types, compress_rates, mlp_layer_types, nested rope_parameters)
    "wide": dict(vocab_size=97, hidden_size=48, moe_intermediate_size=24, num_hidden_layers=4, num_attention_heads=4,
                 head_dim=32, qk_rope_head_dim=8, q_lora_rank=24, num_experts_per_tok=2, n_routed_experts=4,
                 o_groups=2, o_lora_rank=16, index_n_heads=4, index_head_dim=16, index_topk=3, sliding_window=6,
                 layer_types=[CSA, HCA, SLIDING, CSA], compress_rates={CSA: 4, HCA: 8},
                 mlp_layer_types=["hash_moe", "moe", "moe", "moe"], hc_mult=3, hc_sinkhorn_iters=6,
                 rope_scaling=YARN, max_position_embeddings=256, routed_scaling_factor=2.0, swiglu_limit=0.7),
    # the release's spelling (compress_ratios, legacy rate / hash-layer keys, flat rope_scaling)
    "narrow": dict(vocab_size=61, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3,
                   num_attention_heads=8, head_dim=16, qk_rope_head_dim=4, q_lora_rank=20, num_experts_per_tok=3,
                   n_routed_experts=6, o_groups=4, o_lora_rank=8, index_n_heads=2, index_head_dim=8, index_topk=4,
                   sliding_window=5, compress_ratios=[128, 0, 4], compress_rate_hca=16, num_hash_layers=2,
                   hc_mult=2, hc_sinkhorn_iters=20, rope_scaling=YARN, rope_theta=5000.0,
                   compress_rope_theta=40000.0, max_position_embeddings=256, swiglu_limit=1.5),
}


def reference(name: str, seed: int = 0):
    """(transformers model in eval mode, the config.json section the engine reads)."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    kwargs = CONFIGS[name]
    config = DeepseekV4Config(**kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(config).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key, t in model.state_dict().items():
            if t.dtype == torch.int64:  # tid2eid: any expert per token, distinct within a row
                t.copy_(torch.stack([torch.randperm(config.n_routed_experts, generator=g)[:t.shape[1]]
                                     for _ in range(t.shape[0])]))
            elif key.endswith(("norm.weight", "layernorm.weight")):
                t.copy_(1 + 0.2 * torch.randn(t.shape, generator=g))
            elif t.dim() == 1 or key.endswith("position_bias"):  # sinks, biases, mHC base / scale
                t.copy_(0.5 * torch.randn(t.shape, generator=g))
            else:
                t.copy_(torch.randn(t.shape, generator=g) / t.shape[-1] ** 0.5)
    section = {**config.to_dict(), **kwargs} if name == "narrow" else config.to_dict()
    if name == "narrow":  # as released: no transformers-normalised schedule keys
        for k in ("layer_types", "compress_rates", "mlp_layer_types", "rope_parameters"):
            section.pop(k)
    return model, section


def text_config(section: dict):
    return replace(_text(section), section=section, block_kind="mhc", attention_kind="v4", moe_kind="v4_moe")


def engine_state(model) -> dict[str, torch.Tensor]:
    """transformers' state dict with each layer's fused experts split into `experts.E.{gate,up,down}_proj`."""
    out = {}
    for key, t in model.state_dict().items():
        if key.endswith("mlp.experts.gate_up_proj"):
            base, inter = key[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :inter].clone()
                out[f"{base}{e}.up_proj.weight"] = t[e, inter:].clone()
        elif key.endswith("mlp.experts.down_proj"):
            for e in range(t.shape[0]):
                out[f"{key[: -len('down_proj')]}{e}.down_proj.weight"] = t[e].clone()
        else:
            out[key] = t.clone()
    return out


@contextmanager
def earliest_ties():
    """Within it, `Tensor.topk` (transformers' indexer calls it) breaks exact ties towards the lower index, the
    engine's documented rule: torch leaves ties to the kernel, and ReLU scores tie at 0 often."""
    plain = torch.Tensor.topk

    def topk(self, k, dim=-1, largest=True, sorted=True):
        values, indices = torch.sort(self, dim=dim, descending=largest, stable=True)
        return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))

    torch.Tensor.topk = topk
    try:
        yield
    finally:
        torch.Tensor.topk = plain
