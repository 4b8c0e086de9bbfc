"""DeepSeek-V4's engine layers (attention "v4" with CSA / HCA and the indexer, "v4_moe", the "mhc" block and its
stack hooks in engine/model.py) against transformers 5.23 on two tiny configs that are no preset: each layer
on the reference's own inputs, the full stack's logits, and decoding with the V4 cache."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import engine.model as engine_model
from engine.config import ModelConfig
from engine.models.registry import decoder_layer
from engine.layers.linear import PlainLinear, resolve_linears
from engine.layers.slots import load_unit
from engine.models.deepseek_v4.cache import V4LayerState
from engine.models.deepseek_v4.compressor import Indexer
from kconvert.disk_format.units import GLOBALS, layer_unit
from kconvert.distributed import Group
from dsv4_reference import CONFIGS, earliest_ties, engine_state, reference, text_config

pytest.importorskip("transformers")
TOL = 2e-5  # of the reference's largest magnitude, float32


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def ref(request):
    model, section = reference(request.param)
    return SimpleNamespace(name=request.param, model=model, section=section, cfg=text_config(section),
                           state=engine_state(model))


def engine_layer(ref, L: int, par: Group = Group()):
    layer = decoder_layer(ref.cfg, L, par)
    prefix = f"model.layers.{L}."
    resolve_linears(layer, prefix, lambda name: PlainLinear)
    load_unit(layer_unit(L), {prefix: layer}, {k: v for k, v in ref.state.items() if k.startswith(prefix)})
    return layer


def engine_model_of(ref, monkeypatch, dtype=torch.float32) -> engine_model.Model:
    """engine.model.Model over the reference's tensors (its family manifest stood in for: no name mapping)."""
    monkeypatch.setattr(engine_model, "model_config", lambda c, f, *_: ModelConfig(f, ref.cfg, None, c))
    monkeypatch.setattr(engine_model, "bind", lambda c, **_: SimpleNamespace(text=SimpleNamespace(prefix="", module_prefix=""),
                                                                        classify=lambda n: None, renames=False))
    model = engine_model.Model(ref.section, "deepseek_v4", dtype=dtype)
    model.take_unit(GLOBALS, {k: v for k, v in ref.state.items() if not k.startswith("model.layers.")})
    for L in range(ref.cfg.num_layers):
        prefix = f"model.layers.{L}."
        model.take_unit(layer_unit(L), {k: v for k, v in ref.state.items() if k.startswith(prefix)})
    model.check_complete()
    return model


def ids_of(ref, S: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, ref.cfg.vocab_size, (2, S), generator=torch.Generator().manual_seed(seed))


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def test_each_layer_matches_transformers_on_its_inputs(ref):
    ids = ids_of(ref, 40)
    with torch.no_grad(), earliest_ties():
        inputs = ref.model.model.embed_tokens(ids)[:, :, None].expand(-1, -1, ref.cfg.section["hc_mult"], -1)
        states = [inputs.contiguous()]
        hooks = [layer.register_forward_hook(lambda m, a, o: states.append(o)) for layer in ref.model.model.layers]
        ref.model(ids, use_cache=False)
        for h in hooks:
            h.remove()
    errs = []
    for L in range(ref.cfg.num_layers):
        layer = engine_layer(ref, L)
        with torch.no_grad():
            got = layer(states[L], 0, V4LayerState(), None, None, Group(), ids=ids)
        errs.append(rel(got, states[L + 1]))
    print(f"{ref.name}: per-layer max |Δ| / max |ref|: {['%.1e' % e for e in errs]}")
    assert max(errs) < TOL, errs


def test_full_stack_logits_and_decode_match_transformers(ref, monkeypatch):
    model = engine_model_of(ref, monkeypatch)
    ids = ids_of(ref, 40, seed=2)
    with torch.no_grad(), earliest_ties():
        want = ref.model(ids, use_cache=False).logits
    full = model.forward(ids)
    err = rel(full, want)
    # decode: prefill in uneven chunks (windows and the CSA overlap cross calls), then token by token
    cache = model.new_cache(2, 64)
    parts = [model.forward(ids[:, :7], cache), model.forward(ids[:, 7:18], cache)]
    parts += [model.forward(ids[:, t:t + 1], cache) for t in range(18, 40)]
    dec = rel(torch.cat(parts, 1), full)
    print(f"{ref.name}: prefill logits vs transformers {err:.1e}; cached decode vs prefill {dec:.1e}")
    assert err < TOL and dec < TOL, (err, dec)


def test_transformers_decode_with_its_cache_agrees(ref, monkeypatch):
    """The reference's own cached decode equals its prefill too: what our decode is held to is its semantics."""
    ids = ids_of(ref, 24, seed=3)
    with torch.no_grad(), earliest_ties():
        full = ref.model(ids, use_cache=False).logits
        out = ref.model(ids[:, :9], use_cache=True)
        steps = [out.logits]
        cache = out.past_key_values
        for t in range(9, 24):
            out = ref.model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits)
    model = engine_model_of(ref, monkeypatch)
    ecache = model.new_cache(2, 32)
    mine = [model.forward(ids[:, :9], ecache)] + [model.forward(ids[:, t:t + 1], ecache) for t in range(9, 24)]
    assert rel(torch.cat(mine, 1), torch.cat(steps, 1)) < TOL
    assert rel(torch.cat(steps, 1), full) < TOL


def test_indexer_ties_go_to_the_earliest_entries():
    """Equal scores (here: every indexer weight 0, so every score is 0) keep the earliest complete entries."""
    model, section = reference("wide")
    cfg = text_config(section)
    layer = decoder_layer(cfg, 0, Group())  # layer 0 is CSA in "wide"
    indexer = layer.self_attn.compressor.indexer
    assert isinstance(indexer, Indexer)
    state = engine_state(model)
    prefix = "model.layers.0.self_attn.compressor.indexer."
    resolve_linears(indexer, prefix, lambda name: PlainLinear)
    tensors = {k: v for k, v in state.items() if k.startswith(prefix)}
    tensors[prefix + "scorer.weights_proj.weight"] = torch.zeros_like(tensors[prefix + "scorer.weights_proj.weight"])
    load_unit("layer-0000", {prefix: indexer}, tensors)
    x = torch.randn(1, 30, cfg.hidden_size)
    q_lora = torch.randn(1, 30, section["q_lora_rank"])
    pos = torch.arange(30)[None]
    mask = indexer.select(x, q_lora, pos, V4LayerState().indexer, *indexer.rotary(pos, x.dtype))
    k, rate = section["index_topk"], section["compress_rates"]["compressed_sparse_attention"]
    for t in range(30):
        ready = (t + 1) // rate
        assert mask[0, t].nonzero().flatten().tolist() == list(range(min(k, ready))), t


F32_AS_RELEASED = ("sinks", "position_bias", "attn_hc.", "ffn_hc.", "hc_head.", "e_score_correction_bias")


def test_bf16_with_the_release_dtypes_stays_close(ref, monkeypatch):
    """bf16 weights, float32 where the release keeps float32 (sinks, position biases, mHC, router bias): runs
    and stays near the float32 reference (transformers itself in bf16 is as far: mean KLD ~1e-3 here)."""
    bf16 = SimpleNamespace(**{**vars(ref), "state": {
        k: v if v.dtype == torch.int64 or any(s in k for s in F32_AS_RELEASED) else v.bfloat16()
        for k, v in ref.state.items()}})
    model = engine_model_of(bf16, monkeypatch, torch.bfloat16)
    ids = ids_of(ref, 40, seed=2)
    with torch.no_grad(), earliest_ties():
        p = ref.model(ids, use_cache=False).logits.log_softmax(-1)
    q = model.forward(ids).log_softmax(-1)
    kld = (p.exp() * (p - q)).sum(-1).mean().item()
    print(f"{ref.name}: bf16 engine vs float32 transformers: mean KLD {kld:.1e}")
    assert kld < 2e-2


def test_generate_runs_on_the_v4_cache(ref, monkeypatch):
    """engine.runtime.generate over the V4 cache: greedy tokens are those a full forward of the whole text picks; a
    cache cannot be cut back (the compressors do not rewind), only reset."""
    from engine.runtime.generate import Sampling, generate
    from kconvert.errors import EngineError

    model = engine_model_of(ref, monkeypatch)
    prompt = ids_of(ref, 21, seed=7)[0].tolist()
    res = generate(model, prompt, Sampling(max_new_tokens=8))
    text = torch.tensor([prompt + res.tokens[:-1]])
    assert model.forward(text)[0, len(prompt) - 1:].argmax(-1).tolist() == res.tokens
    cache = model.new_cache(1, 64)
    model.forward(text, cache)
    with pytest.raises(EngineError, match="rewind"):
        cache.length = 5
    cache.length = 0
    assert cache.length == 0 and all(s.length == 0 for s in cache.layers)


def test_kv_budget_of_the_mla_cache_is_refused(ref, monkeypatch):
    from engine.cache.latent import KVOptions
    from kconvert.errors import UsageError

    model = engine_model_of(ref, monkeypatch)
    with pytest.raises(UsageError, match="--kv-budget is the MLA cache's"):
        model.new_cache(1, 64, kv=KVOptions(kv_dtype="fp8", budget=1 << 20))
