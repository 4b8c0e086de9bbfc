"""Kimi Linear's and Kimi K3's own config keys, read from TextConfig.section (the text config as released):
KDA's shape and gate, which layers are KDA (from the family manifest's schedule, TextConfig.schedules),
SiTU, the attention-residual block size, the latent MoE width, MLA's output gate."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import TextConfig
from kconvert.errors import CheckpointError, KConvertError

# The MLA layernorms' eps: mlx-lm's kimi_k3 and transformers' kimi_linear both use 1e-6 for q_a_layernorm and
# kv_a_layernorm, whatever `rms_norm_eps` (1e-5 in Kimi K3's config, which the hidden-size norms use) says.
MLA_NORM_EPS = 1e-6
L2_NORM_EPS = 1e-6  # added to sum(x^2) before KDA's q / k L2 normalisation (both references)


@dataclass(frozen=True)
class KimiConfig:
    hidden: int
    kda_heads: int
    kda_head_dim: int
    conv_kernel: int
    lower_bound: float | None  # KDA gate: lower_bound * sigmoid(...); None: -exp(A_log) * softplus(...)
    full_rank_gate: bool  # KDA output gate g_proj [P, hidden], else g_a_proj / g_b_proj
    kda_layers: tuple[bool, ...]  # per decoder layer
    activation: str  # "situ" | "silu"
    situ_beta: float
    situ_linear_beta: float | None
    attn_res_block: int  # layers per attention-residual block; 0: a plain residual
    experts: int
    top_k: int
    shared_experts: int
    moe_inter: int
    latent: int  # routed experts' width; 0: the hidden size
    latent_norm: bool
    routed_scale: float
    renormalize: bool
    first_dense: int
    moe_layer_freq: int
    mla_gate: bool
    mla_nope: bool
    eps: float

    def is_moe(self, layer: int) -> bool:
        return self.experts > 0 and layer >= self.first_dense and layer % self.moe_layer_freq == 0


def kimi_config(cfg: TextConfig) -> KimiConfig:
    c, kinds = cfg.reads(), cfg.schedules.get("attn_kind")
    lin = c.get("linear_attn_config") or {}
    if kinds is None or not lin:
        raise CheckpointError(f"{c.prefix}linear_attn_config is absent: the KDA layers and their shape are unknown",
                              file=c.file)
    try:
        lower = lin.get("gate_lower_bound")
        return KimiConfig(
            hidden=int(c["hidden_size"]), kda_heads=int(lin["num_heads"]), kda_head_dim=int(lin["head_dim"]),
            conv_kernel=int(lin["short_conv_kernel_size"]), lower_bound=None if lower is None else float(lower),
            full_rank_gate=bool(lin.get("use_full_rank_gate", False)), kda_layers=tuple(k == "kda" for k in kinds),
            activation=c.get("hidden_act") or "silu", situ_beta=float(c.get("activation_situ_beta") or 1.0),
            situ_linear_beta=None if c.get("activation_situ_linear_beta") is None else float(c["activation_situ_linear_beta"]),
            attn_res_block=int(c.get("attn_res_block_size") or 0), experts=int(c.get("num_experts") or 0),
            top_k=int(c.get("num_experts_per_token") or 0), shared_experts=int(c.get("num_shared_experts") or 0),
            moe_inter=int(c.get("moe_intermediate_size") or 0), latent=int(c.get("routed_expert_hidden_size") or 0),
            latent_norm=bool(c.get("latent_moe_use_norm", False)),
            routed_scale=float(c.get("routed_scaling_factor") or 1.0), renormalize=bool(c.get("moe_renormalize", True)),
            first_dense=int(c.get("first_k_dense_replace") or 0), moe_layer_freq=int(c.get("moe_layer_freq") or 1),
            mla_gate=bool(c.get("mla_use_output_gate", False)), mla_nope=bool(c.get("mla_use_nope", False)),
            eps=float(c.get("rms_norm_eps") or 1e-6))
    except (KConvertError, KeyError, TypeError, ValueError) as e:
        raise c.error(e) from None
