"""engine/models/kimi_linear/ops.py against the references: mlx_lm (kimi_k3 / kimi_linear / gated_delta, run on
the CPU through their pure-ops paths) and transformers' kimi_linear torch fallback, on fresh seeded random inputs.
Over 300 lines: each op against two references, with the negative controls that show each check can fail."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine.models.kimi_linear import ops

mx = pytest.importorskip("mlx.core")
gated_delta = pytest.importorskip("mlx_lm.models.gated_delta")
mlx_kimi_linear = pytest.importorskip("mlx_lm.models.kimi_linear")
mlx_kimi_k3 = pytest.importorskip("mlx_lm.models.kimi_k3")

F32_TOL = 1e-5
B, H = 2, 3
EPS = 1e-6  # the l2-norm eps of both references


def to_mx(t: torch.Tensor):
    array = mx.array(t.detach().float().numpy())
    return array.astype(mx.bfloat16) if t.dtype == torch.bfloat16 else array


def to_torch(a) -> torch.Tensor:
    return torch.from_numpy(np.array(a.astype(mx.float32)))


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


def kda_inputs(seed: int, d: int, t: int, lower_bound, dtype=torch.float32):
    """Raw (pre-normalisation) KDA inputs; the gate logits are wide so the per-channel decays differ strongly."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape, scale=1.0: (torch.randn(*shape, generator=gen) * scale).to(dtype)  # noqa: E731
    return SimpleNamespace(
        q=rand(B, t, H, d),
        k=rand(B, t, H, d),
        v=rand(B, t, H, d),
        a=rand(B, t, H, d, scale=2.0),
        b=rand(B, t, H, scale=2.0),
        A_log=torch.rand(H, generator=gen) * 2.0,
        dt_bias=torch.randn(H, d, generator=gen),
        state=torch.randn(B, H, d, d, generator=gen) * 0.5,  # [B, H, Dk, Dv], deliberately not symmetric
        lower_bound=lower_bound,
        scale=d**-0.5,
    )


def ours_kda(x, kda=ops.kda_recurrent, **kwargs):
    q, k = ops.l2_normalize_qk(x.q, x.k, x.scale, EPS)
    g = ops.kda_gate(x.a, x.A_log, x.dt_bias, x.lower_bound)
    return kda(q, k, x.v, g, torch.sigmoid(x.b), x.state, **kwargs)


def mlx_kda(x):
    """mlx's whole KDA core: normalize_qk, its own gate and beta, the ops-path recurrence. State back to [Dk, Dv]."""
    q, k = gated_delta.normalize_qk(to_mx(x.q), to_mx(x.k), inv_scale=x.scale, eps=EPS)
    y, state = gated_delta.gated_delta_update(
        q,
        k,
        to_mx(x.v),
        to_mx(x.a),
        to_mx(x.b),
        to_mx(x.A_log).reshape(H, 1),
        to_mx(x.dt_bias),
        state=to_mx(x.state.transpose(-1, -2)),
        use_kernel=False,
        lower_bound=x.lower_bound,
    )
    return to_torch(y), to_torch(state).transpose(-1, -2)


CASES = [(d, t) for d in (16, 32, 128) for t in (1, 5, 64, 131)]


@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["lower_bound", "softplus"])
@pytest.mark.parametrize("d,t", CASES)
def test_kda_matches_mlx(d, t, lower_bound):
    x = kda_inputs(1000 * d + t, d, t, lower_bound)
    mlx_out, mlx_state = mlx_kda(x)
    for kda in (ops.kda_recurrent, ops.kda_chunked):
        out, state = ours_kda(x, kda)
        assert out.shape == (B, t, H, d) and state.shape == (B, H, d, d) and state.dtype == torch.float32
        assert rel_err(out, mlx_out) < F32_TOL, kda.__name__
        assert rel_err(state, mlx_state) < F32_TOL, kda.__name__


@pytest.mark.parametrize("d,t", [(16, 5), (32, 131), (128, 64)])
def test_kda_matches_transformers(d, t):
    """transformers' torch fallback (flash-linear-attention is not installed, so the torch path runs): it
    normalises and scales q, k itself. Its chunked fallback sums the log-decay in float32, which costs it a few
    1e-6 against its own recurrence, hence the looser bound there."""
    tf = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    x = kda_inputs(7 * d + t, d, t, -5.0)
    g = ops.kda_gate(x.a, x.A_log, x.dt_bias, x.lower_bound)
    beta = torch.sigmoid(x.b)
    common = dict(g=g, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    tf_out, tf_state = tf.recurrent_kimi_delta_attention(x.q, x.k, x.v, initial_state=x.state.clone(), **common)
    tf_chunk_out, tf_chunk_state = tf.chunk_kimi_delta_attention(x.q, x.k, x.v, initial_state=x.state.clone(), **common)
    for kda in (ops.kda_recurrent, ops.kda_chunked):
        out, state = ours_kda(x, kda)
        assert rel_err(out, tf_out) < F32_TOL and rel_err(state, tf_state) < F32_TOL, kda.__name__
        assert rel_err(out, tf_chunk_out) < 2e-5 and rel_err(state, tf_chunk_state) < 2e-5, kda.__name__


def test_kda_gate_matches_references():
    tf = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    gen = torch.Generator().manual_seed(3)
    d, t, hidden = 32, 9, 48
    gate = tf.KimiLinearForgetGate(SimpleNamespace(hidden_size=hidden, linear_head_dim=d, linear_num_heads=H))
    with torch.no_grad():
        for param in gate.parameters():
            param.copy_(torch.randn(param.shape, generator=gen))
        hidden_states = torch.randn(B, t, hidden, generator=gen)
        a = gate.f_b_proj(gate.f_a_proj(hidden_states)).reshape(B, t, H, d)
        tf_g = gate(hidden_states)
    # transformers' own parameter shapes: A_log [1, 1, H, 1], dt_bias [H*D]
    assert rel_err(ops.kda_gate(a, gate.A_log, gate.dt_bias, None), tf_g) < F32_TOL
    A_log, dt_bias = gate.A_log.detach().reshape(H), gate.dt_bias.detach().reshape(H, d)
    ours = ops.kda_gate(a, A_log, dt_bias, None)
    mlx_decay = gated_delta.compute_g(to_mx(A_log).reshape(H, 1), to_mx(a), to_mx(dt_bias))
    assert rel_err(ours.exp(), to_torch(mlx_decay)) < F32_TOL
    for lower_bound in (-5.0, -1.0):
        ours = ops.kda_gate(a.bfloat16(), A_log, dt_bias, lower_bound)
        assert ours.dtype == torch.float32 and ours.min() >= lower_bound
        mlx_decay = gated_delta.compute_lower_bound_g(
            to_mx(A_log).reshape(H, 1), to_mx(a.bfloat16()), to_mx(dt_bias), lower_bound
        )
        assert rel_err(ours.exp(), to_torch(mlx_decay)) < F32_TOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [16, 128])
def test_l2_normalize_qk_matches_mlx(d, dtype):
    gen = torch.Generator().manual_seed(d)
    q, k = (torch.randn(B, 7, H, d, generator=gen).to(dtype) for _ in range(2))
    q[0, 0, 0] = 0.0  # the eps is what keeps a zero vector finite
    ours_q, ours_k = ops.l2_normalize_qk(q, k, d**-0.5, EPS)
    mlx_q, mlx_k = gated_delta.normalize_qk(to_mx(q), to_mx(k), inv_scale=d**-0.5, eps=EPS)
    assert ours_q.dtype == dtype and ours_k.dtype == dtype
    # bf16: mlx rounds twice (rms_norm, then the scale), we round once: within one bf16 ulp
    tol = F32_TOL if dtype == torch.float32 else 2**-7
    assert rel_err(ours_q, to_torch(mlx_q)) < tol and rel_err(ours_k, to_torch(mlx_k)) < tol
    assert torch.allclose(ours_k.float().norm(dim=-1)[0, 1:], torch.ones(6, H), atol=1e-2)


def test_kda_bf16_inputs_match_mlx():
    """bf16 q, k, v, beta: both sides compute in float32 (state float32), outputs come back in bf16."""
    d, t = 32, 70
    x = kda_inputs(11, d, t, -5.0, dtype=torch.bfloat16)
    q, k = ops.l2_normalize_qk(x.q, x.k, x.scale, EPS)
    g = ops.kda_gate(x.a, x.A_log, x.dt_bias, x.lower_bound)
    beta = torch.sigmoid(x.b)
    mlx_y, mlx_state = gated_delta.gated_delta_ops(
        to_mx(q), to_mx(k), to_mx(x.v), to_mx(g.exp()), to_mx(beta), to_mx(x.state.transpose(-1, -2))
    )
    assert mlx_y.dtype == mx.bfloat16
    for kda in (ops.kda_recurrent, ops.kda_chunked):
        out, state = kda(q, k, x.v, g, beta, x.state)
        assert out.dtype == torch.bfloat16 and state.dtype == torch.float32
        assert rel_err(state, to_torch(mlx_state).transpose(-1, -2)) < F32_TOL, kda.__name__
        assert rel_err(out, to_torch(mlx_y)) < 2**-7, kda.__name__  # one bf16 rounding of the same float32


def np_kda(q, k, v, g, beta, state, per_channel_decay=True, beta_on_error=True):
    """Independent float64 loop, with switches for the two classic mistakes."""
    q, k, v, g, beta, s = (np.asarray(x, dtype=np.float64) for x in (q, k, v, g, beta, state))
    if not per_channel_decay:
        g = np.repeat(g.mean(-1, keepdims=True), g.shape[-1], axis=-1)
    out = np.zeros_like(v)
    for t in range(q.shape[1]):
        s = s * np.exp(g[:, t])[..., None]
        b = beta[:, t][..., None]
        predicted = np.einsum("bhk,bhkv->bhv", k[:, t], s)
        error = b * (v[:, t] - predicted) if beta_on_error else b * v[:, t] - predicted
        s = s + k[:, t][..., None] * error[..., None, :]
        out[:, t] = np.einsum("bhk,bhkv->bhv", q[:, t], s)
    return torch.from_numpy(out), torch.from_numpy(s)


def test_kda_conventions_are_pinned():
    """The comparisons above can fail: with these inputs a per-head decay or beta applied to v only moves the
    result by far more than the tolerance, while ours and mlx agree with the per-channel, beta-on-error rule."""
    d, t = 32, 40
    x = kda_inputs(5, d, t, -5.0)
    q, k = ops.l2_normalize_qk(x.q, x.k, x.scale, EPS)
    g = ops.kda_gate(x.a, x.A_log, x.dt_bias, x.lower_bound)
    beta = torch.sigmoid(x.b)
    assert (g.amax(-1) - g.amin(-1)).min() > 1.0  # every head's channels decay very differently
    ref_out, ref_state = np_kda(q, k, x.v, g, beta, x.state)
    mlx_out, mlx_state = mlx_kda(x)
    assert rel_err(mlx_out, ref_out) < F32_TOL and rel_err(mlx_state, ref_state) < F32_TOL
    for kda in (ops.kda_recurrent, ops.kda_chunked):
        out, state = kda(q, k, x.v, g, beta, x.state)
        assert rel_err(out, ref_out) < F32_TOL and rel_err(state, ref_state) < F32_TOL, kda.__name__
    for mistake in (dict(per_channel_decay=False), dict(beta_on_error=False)):
        wrong_out, wrong_state = np_kda(q, k, x.v, g, beta, x.state, **mistake)
        assert rel_err(wrong_out, ref_out) > 1e3 * F32_TOL, mistake
        assert rel_err(wrong_state, ref_state) > 1e3 * F32_TOL, mistake


@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["lower_bound", "softplus"])
@pytest.mark.parametrize("chunk", [16, 64])
def test_kda_chunked_equals_recurrent_under_strong_decay(chunk, lower_bound):
    """T = 300 (not a multiple of the chunk), nonzero incoming state, decays saturated so that a 64-step chunk's
    cumulative log-decay is far below -88: exp(-G) would overflow float32, so a chunked form that divides by
    the decay from the chunk start fails here."""
    d, t = 64, 300
    x = kda_inputs(17 + chunk, d, t, lower_bound)
    x.a = x.a * 4.0 + 6.0
    x.A_log = x.A_log + 1.0
    q, k = ops.l2_normalize_qk(x.q, x.k, x.scale, EPS)
    g = ops.kda_gate(x.a, x.A_log, x.dt_bias, x.lower_bound)
    beta = torch.sigmoid(x.b)
    assert g[:, :64].sum(1).min() < -120.0
    rec_out, rec_state = ops.kda_recurrent(q, k, x.v, g, beta, x.state)
    chunk_out, chunk_state = ops.kda_chunked(q, k, x.v, g, beta, x.state, chunk=chunk)
    assert torch.isfinite(chunk_out).all() and torch.isfinite(chunk_state).all()
    assert rel_err(chunk_out, rec_out) < F32_TOL and rel_err(chunk_state, rec_state) < F32_TOL


def test_kda_prefill_then_decode_continues_the_state():
    d, t, split = 32, 131, 100
    x = kda_inputs(23, d, t, -5.0)
    q, k = ops.l2_normalize_qk(x.q, x.k, x.scale, EPS)
    g = ops.kda_gate(x.a, x.A_log, x.dt_bias, x.lower_bound)
    beta = torch.sigmoid(x.b)
    full_out, full_state = ops.kda_chunked(q, k, x.v, g, beta, None)
    head_out, state = ops.kda_chunked(q[:, :split], k[:, :split], x.v[:, :split], g[:, :split], beta[:, :split])
    tail = []
    for i in range(split, t):
        step = slice(i, i + 1)
        out, state = ops.kda_recurrent(q[:, step], k[:, step], x.v[:, step], g[:, step], beta[:, step], state)
        tail.append(out)
    assert rel_err(torch.cat([head_out, *tail], dim=1), full_out) < F32_TOL
    assert rel_err(state, full_state) < F32_TOL


def mlx_conv(channels, weight, x, state):
    conv = mlx_kimi_linear.ShortConv1d(channels, weight.shape[-1])
    conv.conv.weight = to_mx(weight.unsqueeze(-1))  # mlx Conv1d weight: [C_out, K, C_in / groups]
    y, new_state = conv(to_mx(x), None if state is None else to_mx(state), None, None)
    return to_torch(y), to_torch(new_state)


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("t", [1, 2, 5, 64])
def test_short_conv_matches_mlx(t, with_state):
    gen = torch.Generator().manual_seed(t)
    channels, kernel = 3 * H * 16, 4
    weight = torch.randn(channels, kernel, generator=gen)
    x = torch.randn(B, t, channels, generator=gen)
    state = torch.randn(B, kernel - 1, channels, generator=gen) if with_state else None
    y, new_state = ops.short_conv(x, weight, state)
    mlx_y, mlx_state = mlx_conv(channels, weight, x, state)
    assert y.shape == x.shape and new_state.shape == (B, kernel - 1, channels)
    assert rel_err(y, mlx_y) < F32_TOL
    assert torch.equal(new_state, mlx_state)  # T < K - 1 keeps part of the old state


def test_short_conv_streams_and_matches_transformers():
    tf = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    gen = torch.Generator().manual_seed(9)
    channels, kernel = 40, 4
    weight = torch.randn(channels, kernel, generator=gen)
    x = torch.randn(B, 7, channels, generator=gen)
    full, full_state = ops.short_conv(x, weight, None)
    tf_full = tf.causal_conv1d_fn(x.transpose(1, 2), weight, activation="silu").transpose(1, 2)
    assert rel_err(full, tf_full) < F32_TOL
    pieces, state = [], None
    for part in x.split([1, 2, 4], dim=1):  # decode-sized pieces carry the state between calls
        y, state = ops.short_conv(part, weight, state)
        pieces.append(y)
    assert rel_err(torch.cat(pieces, dim=1), full) < F32_TOL and torch.equal(state, full_state)
    bf16, _ = ops.short_conv(x.bfloat16(), weight.bfloat16(), None)
    mlx_bf16, _ = mlx_conv(channels, weight.bfloat16(), x.bfloat16(), None)
    assert bf16.dtype == torch.bfloat16 and rel_err(bf16, mlx_bf16) < 2**-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("linear_beta", [25.0, None])
def test_situ_matches_mlx(linear_beta, dtype):
    gen = torch.Generator().manual_seed(31)
    for shape in [(5,), (2, 3, 64), (4, 1, 257)]:
        up = (torch.randn(*shape, generator=gen) * 30.0).to(dtype)  # reaches the tanh saturation of both betas
        gate = (torch.randn(*shape, generator=gen) * 10.0).to(dtype)
        ours = ops.situ(up, gate, 4.0, linear_beta)
        theirs = to_torch(mlx_kimi_k3._situ(to_mx(up), to_mx(gate), 4.0, linear_beta))
        assert ours.dtype == dtype
        tol = F32_TOL if dtype == torch.float32 else 2**-7
        assert rel_err(ours, theirs) < tol
    assert not torch.allclose(ops.situ(up, gate, 4.0, 25.0).float(), ops.situ(up, gate, 4.0, None).float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_blocks", [0, 1, 3])
def test_attn_res_mix_matches_mlx(n_blocks, dtype):
    gen = torch.Generator().manual_seed(41 + n_blocks)
    d, eps = 64, 1e-5
    blocks = (torch.randn(n_blocks, B, 5, d, generator=gen) * torch.rand(n_blocks, 1, 1, 1, generator=gen) * 4).to(dtype)
    partial = torch.randn(B, 5, d, generator=gen).to(dtype)
    norm_w = (1.0 + 0.1 * torch.randn(d, generator=gen)).to(dtype)
    proj_w = (torch.randn(1, d, generator=gen) * 0.5).to(dtype)  # nn.Linear(d, 1).weight
    w_eff = ops.attn_res_logit_weights(norm_w, proj_w)
    mlx_w_eff = to_mx(norm_w).astype(mx.float32) * to_mx(proj_w).reshape(-1)
    assert w_eff.dtype == torch.float32 and rel_err(w_eff, to_torch(mlx_w_eff)) == 0.0
    residual = mlx_kimi_k3.ResidualBlocks(eps)
    for block in blocks:
        residual.append(to_mx(block))
    theirs = to_torch(mlx_kimi_k3._attn_res_mix(residual, to_mx(partial), mlx_w_eff, eps, use_kernel=False))
    ours = ops.attn_res_mix(blocks, partial, w_eff, eps)
    assert ours.dtype == dtype and ours.shape == partial.shape
    tol = F32_TOL if dtype == torch.float32 else 2**-7
    assert rel_err(ours, theirs) < tol
    if n_blocks:  # the mix is not a plain average: the softmax weights matter
        assert rel_err(ours, torch.cat([blocks, partial[None]]).float().mean(0)) > 1e-2
