"""Pure tensor ops of Kimi Linear / Kimi K3: short conv, KDA gate and recurrence, SiTU, block AttnRes mix.

KDA (Kimi Delta Attention), per batch row and head, with state S [Dk, Dv] in float32:
    S <- diag(exp(g_t)) S                  decay first, per KEY CHANNEL (g_t [Dk], log space, <= 0)
    S <- S + k_t (beta_t (v_t - S^T k_t))^T   delta rule against the decayed state; beta scales the whole error
    o_t = S^T q_t                            read out from the updated state
Both references use this order (mlx_lm gated_delta._gated_delta_step_ops; transformers kimi_linear
recurrent_kimi_delta_attention). Conventions followed here:
  * state layout [B, H, Dk, Dv]: transformers/FLA's. mlx keeps the transpose [B, H, Dv, Dk] (convert with
    .transpose(-1, -2)).
  * g is the log-decay (transformers/FLA); mlx's gated_delta_update takes exp(g).
  * q, k are L2-normalised with eps 1e-6 added to sum(x^2) (both references), and q carries head_dim**-0.5.
    Like mlx, the scale is folded into q by l2_normalize_qk, so kda_recurrent/kda_chunked apply no scale
    (transformers scales inside its kernel instead: same numbers).
  * inputs may be bf16; the recurrence runs in float32, outputs come back in q's dtype, the state in float32.

SiTU(up, gate) = beta*tanh(gate/beta)*sigmoid(gate) * linear_beta*tanh(up/linear_beta), in float32.

Block AttnRes: before a sublayer, sources = completed block sums (block 0 = the embedding) then the running
partial sum; logit_i = <v_i / rms(v_i), norm_w * proj_w>; softmax over sources in float32; output =
sum_i p_i v_i of the raw sources (mlx_lm kimi_k3._attn_res_combine).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def short_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None):
    """Causal depthwise conv + SiLU. x [B, T, C], weight [C, K] (or the checkpoint's [C, 1, K]), state [B, K-1, C]
    (the previous K-1 inputs) or None.

    Returns (y [B, T, C] in x's dtype, new_state [B, K-1, C] = the last K-1 inputs, older state included)."""
    batch, _, channels = x.shape
    weight = weight.reshape(channels, -1)
    kernel = weight.shape[-1]
    if state is None:
        state = x.new_zeros(batch, kernel - 1, channels)
    padded = torch.cat([state.to(x.dtype), x], dim=1)
    conv = F.conv1d(padded.float().transpose(1, 2), weight.float().unsqueeze(1), groups=channels)
    y = F.silu(conv).transpose(1, 2).to(x.dtype)
    new_state = padded[:, padded.shape[1] - (kernel - 1) :]
    return y, new_state


def kda_gate(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None = None):
    """Log-space decay g [B, T, H, D] float32 from a = f_b(f_a x) [B, T, H, D], A_log [H], dt_bias [H, D]
    (the checkpoints' [1, 1, H, 1] A_log and flat [H*D] dt_bias are accepted too).

    lower_bound set (Kimi K3 gate_lower_bound, -5):  g = lower_bound * sigmoid(exp(A_log) * (a + dt_bias));
    lower_bound None (Kimi Linear):                    g = -exp(A_log) * softplus(a + dt_bias)."""
    logits = a.float() + dt_bias.float().reshape(a.shape[-2:])
    rate = A_log.float().exp().reshape(-1, 1)  # one rate per head, shared by its channels
    if lower_bound is None:
        return -rate * F.softplus(logits)
    return lower_bound * torch.sigmoid(rate * logits)


def l2_normalize_qk(q: torch.Tensor, k: torch.Tensor, scale: float, eps: float = 1e-6):
    """q * scale / sqrt(sum q^2 + eps), k / sqrt(sum k^2 + eps) over the last dim, in float32, returned in the
    input dtype (mlx normalize_qk's result; it folds scale = head_dim**-0.5 into q). Pass float32 to keep full
    precision, as transformers does after its float cast."""

    def normalize(x: torch.Tensor, factor: float) -> torch.Tensor:
        xf = x.float()
        return (factor * xf * torch.rsqrt(xf.square().sum(-1, keepdim=True) + eps)).to(x.dtype)

    return normalize(q, scale), normalize(k, 1.0)


def _initial_state(state, k, v):
    """The incoming state in float32, zeros [B, H, Dk, Dv] when None."""
    if state is None:
        batch, _, heads, dk = k.shape
        return torch.zeros(batch, heads, dk, v.shape[-1], dtype=torch.float32, device=k.device)
    return state.float()


def kda_recurrent(q, k, v, g, beta, state=None):
    """Token-by-token KDA. q, k, v [B, T, H, D] (normalised, q scaled), g [B, T, H, Dk] log-decay, beta [B, T, H],
    state [B, H, Dk, Dv] float32 or None. Returns (o [B, T, H, Dv] in q's dtype, state [B, H, Dk, Dv] float32)."""
    state = _initial_state(state, k, v)
    # head-major float32 copies: [B, H, T, D], beta [B, H, T]
    qf, kf, vf, gf = (x.float().transpose(1, 2) for x in (q, k, v, g))
    betaf = beta.float().transpose(1, 2)
    decay = gf.exp()
    outputs = []
    for t in range(qf.shape[2]):
        state = state * decay[:, :, t].unsqueeze(-1)
        k_t = kf[:, :, t]
        predicted = (k_t.unsqueeze(-1) * state).sum(-2)  # S^T k, [B, H, Dv]
        delta = betaf[:, :, t].unsqueeze(-1) * (vf[:, :, t] - predicted)
        state = state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        outputs.append((qf[:, :, t].unsqueeze(-1) * state).sum(-2))
    o = torch.stack(outputs, dim=1) if outputs else vf.new_zeros(v.shape)
    return o.to(q.dtype), state


# Decay factors below exp(-80) (~1e-35) are zero at float32 precision; flooring the exponent there keeps exp
# out of the denormal range, where it runs ~10x slower on CPU.
_LOG_DECAY_FLOOR = -80.0


def _exp32(log_decay: torch.Tensor) -> torch.Tensor:
    """exp of a log-decay (difference) formed in float64, as a fresh float32 tensor."""
    return log_decay.to(torch.float32, copy=True).clamp_(min=_LOG_DECAY_FLOOR).exp_()


def _causal_decayed_scores(a, b, cum_g):
    """scores[..., t, s] = sum_d a_t[d] b_s[d] exp(G_t[d] - G_s[d]) for s <= t, else 0; a, b, cum_g [..., C, D],
    C a power of two (a may carry extra leading dims: several left operands then share the decay factors).

    Built by binary halving: the diagonal holds a_t . b_t (no decay), and each lower-left quadrant (t in the later
    half, s in the earlier half) is one matmul with the decay split at the earlier half's last position r,
    exp(G_t - G_r) * exp(G_r - G_s): both exponents are differences of cumulative log-decays that are <= 0, so
    nothing overflows however strong the decay. Cost per chunk: C*D*log2(C) elementwise + C^2*D/2 in matmuls."""
    length = a.shape[-2]
    blocks = (a * b).sum(-1)[..., None, None]  # [..., C blocks, 1, 1]
    size = 1
    while size < length:
        pairs = length // (2 * size)

        def halves(x):
            return x.reshape(*x.shape[:-2], pairs, 2, size, x.shape[-1])

        a_h, b_h, g_h = halves(a), halves(b), halves(cum_g)
        ref = g_h[..., 0, size - 1 : size, :]
        a_late = a_h[..., 1, :, :] * _exp32(g_h[..., 1, :, :] - ref)
        b_early = b_h[..., 0, :, :] * _exp32(ref - g_h[..., 0, :, :])
        cross = a_late @ b_early.transpose(-1, -2)  # [..., pairs, size, size]
        earlier, later = blocks[..., 0::2, :, :], blocks[..., 1::2, :, :]
        top = torch.cat([earlier, torch.zeros_like(earlier)], dim=-1)
        blocks = torch.cat([top, torch.cat([cross, later], dim=-1)], dim=-2)
        size *= 2
    return blocks.squeeze(-3)


def kda_chunked(q, k, v, g, beta, state=None, chunk: int = 64):
    """KDA over chunks (WY / UT-transform form with per-channel decay), same contract and result as kda_recurrent.

    Within a chunk, with G the cumulative log-decay and S0 the incoming state, the per-token errors
    u_t = beta_t (v_t - Sbar_t^T k_t) satisfy (I + A) U = beta V - (beta K * e^G) S0 with
    A[t, s] = beta_t sum_d k_t k_s e^(G_t - G_s) (s < t); so U = U0 - W S0 after one triangular solve, then
    o = (Q * e^G) S0 + Aqk U (Aqk inclusive of s = t) and S = diag(e^G_last) S0 + (K * e^(G_last - G))^T U.
    Everything but the short chunk-to-chunk loop is batched over chunks; cost is linear in T. chunk: a power of
    two (the within-chunk scores are built by halving)."""
    state = _initial_state(state, k, v)
    batch, length, heads, _ = k.shape
    if chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two, got {chunk}")
    size = min(chunk, 1 << max(0, length - 1).bit_length())  # short inputs: the smallest power of two >= T
    pad = (-length) % size
    n_chunks = (length + pad) // size

    def chunk_major(x):
        """[B, T, H, D] -> float32 [N, B, H, C, D], contiguous so that each chunk is a dense slice. The padded
        steps have zero k, v, beta and g: they neither decay nor write the state."""
        x = F.pad(x.float(), (0, 0, 0, 0, 0, pad))
        return x.reshape(batch, n_chunks, size, heads, x.shape[-1]).permute(1, 0, 3, 2, 4).contiguous()

    qf, kf, vf, gf, betaf = (chunk_major(x) for x in (q, k, v, g, beta.unsqueeze(-1)))
    # float64 cumulative log-decay: in float32 a sum reaching -300 carries ~1e-5 absolute error, which would
    # become ~1e-5 relative error in every decay factor exp(G_t - G_s); the differences are exact enough in float64.
    cum_g = gf.double().cumsum(-2)
    decay_from_start = _exp32(cum_g)
    k_beta = kf * betaf
    scores = _causal_decayed_scores(torch.stack([k_beta, qf]), kf, cum_g)
    a_kk, a_qk = scores[0].tril(-1), scores[1]
    rhs = torch.cat([vf * betaf, k_beta * decay_from_start], dim=-1)
    # unitriangular: the solve takes the unit diagonal of I + a_kk as given
    solved = torch.linalg.solve_triangular(a_kk, rhs, upper=False, unitriangular=True)
    u0, w = solved[..., : vf.shape[-1]], solved[..., vf.shape[-1] :].contiguous()

    q_decayed = qf * decay_from_start
    last = cum_g[..., -1:, :]
    k_to_end_t = (kf * _exp32(last - cum_g)).transpose(-1, -2).contiguous()  # [N, B, H, Dk, C]
    decay_chunk = _exp32(last).transpose(-1, -2)  # [N, B, H, Dk, 1]

    outputs = []
    for n in range(n_chunks):
        u = u0[n] - w[n] @ state
        outputs.append(q_decayed[n] @ state + a_qk[n] @ u)
        state = decay_chunk[n] * state + k_to_end_t[n] @ u
    o = torch.cat(outputs, dim=-2)[..., :length, :] if outputs else vf.new_zeros(batch, heads, 0, vf.shape[-1])
    return o.transpose(1, 2).to(q.dtype), state


def situ(up: torch.Tensor, gate: torch.Tensor, beta: float, linear_beta: float | None = None) -> torch.Tensor:
    """SiTU: beta*tanh(gate/beta)*sigmoid(gate) * (linear_beta*tanh(up/linear_beta) or up), float32 inside."""
    gate_f = gate.float()
    up_f = up.float()
    activated = beta * torch.tanh(gate_f / beta) * torch.sigmoid(gate_f)
    if linear_beta is not None:
        up_f = linear_beta * torch.tanh(up_f / linear_beta)
    return (activated * up_f).to(up.dtype)


def attn_res_logit_weights(norm_weight: torch.Tensor, proj_weight: torch.Tensor) -> torch.Tensor:
    """w_eff [D] float32 = RMSNorm weight * the 1-output projection's weight ([1, D] or [D])."""
    return norm_weight.float() * proj_weight.float().reshape(-1)


def attn_res_mix(blocks: torch.Tensor, partial: torch.Tensor, w_eff: torch.Tensor, eps: float) -> torch.Tensor:
    """Softmax-weighted mix of the completed blocks [K, ..., D] (K may be 0) and the partial sum [..., D].

    The logits use the RMS-normalised sources; the mix uses the raw ones. Returns partial's dtype."""
    if blocks.shape[0] == 0:  # nothing to mix with: mlx returns the partial sum unchanged
        return partial
    sources = torch.cat([blocks.float(), partial.float().unsqueeze(0)])
    inv_rms = torch.rsqrt(sources.square().mean(-1) + eps)
    logits = (sources @ w_eff.float()) * inv_rms
    weights = torch.softmax(logits, dim=0)
    return (weights.unsqueeze(-1) * sources).sum(0).to(partial.dtype)
