"""DeepSeek-V4's engine layers (attention "v4" with CSA / HCA and the indexer, "v4_moe", the "mhc" block and its
stack hooks in engine/model.py) against transformers 5.23 on two tiny configs that are no preset: each layer
on the reference's own inputs, the full stack's logits, and decoding with the dense cache."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import engine.model as engine_model
from engine.config import ModelConfig
from engine.layers import decoder_layer
from engine.linear import PlainLinear, resolve_linears
from engine.slots import load_unit
from engine.v4_cache import V4LayerState
from engine.v4_compressor import Indexer
from kconvert.converted.units import GLOBALS, layer_unit
from kconvert.distributed import Group
from v4_reference import CONFIGS, earliest_ties, engine_state, reference, text_config

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
    monkeypatch.setattr(engine_model, "model_config", lambda c, f: ModelConfig(f, ref.cfg, None, c))
    monkeypatch.setattr(engine_model, "bind", lambda c: SimpleNamespace(text=SimpleNamespace(prefix=""),
                                                                        classify=lambda n: None))
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
    mask = indexer.select(x, q_lora, pos, V4LayerState().indexer)
    k, rate = section["index_topk"], section["compress_rates"]["compressed_sparse_attention"]
    for t in range(30):
        ready = (t + 1) // rate
        assert mask[0, t].nonzero().flatten().tolist() == list(range(min(k, ready))), t


class ThreadGroup(Group):
    """A tp rank run as a thread: all_reduce sums over the ranks' threads (no process group needed)."""

    def __init__(self, rank: int, tp: int, shared: dict):
        super().__init__(rank=rank, world=tp, tp=tp)
        self.shared = shared

    def all_reduce(self, x):
        box, barrier = self.shared["box"], self.shared["barrier"]
        box[self.rank] = x.clone()
        barrier.wait()
        total = sum(box[r] for r in sorted(box))
        barrier.wait()
        x.copy_(total)
        return x


def rank_slice(name: str, t: torch.Tensor, rank: int, tp: int, experts: int):
    """Rank `rank`'s share of a layer tensor under the V4 rules: heads / groups / shared expert split, routed
    experts whole per rank, the rest replicated (None: not on this rank)."""
    if ".mlp.experts." in name:
        e = int(name.split(".mlp.experts.")[1].split(".")[0])
        return t if e // (experts // tp) == rank else None
    col = ("self_attn.q_b_proj.weight", "self_attn.o_a_proj.weight", "self_attn.sinks",
           "shared_experts.gate_proj.weight", "shared_experts.up_proj.weight")
    row = ("self_attn.o_b_proj.weight", "shared_experts.down_proj.weight")
    if name.endswith(col):
        return t.chunk(tp, 0)[rank].clone()
    if name.endswith(row):
        return t.chunk(tp, 1)[rank].clone()
    return t


def test_tp2_layers_equal_tp1(ref):
    """Each decoder layer at tp 2 (ranks as threads, the V4 slicing rules) gives the tp 1 output, prefill and
    a cached decode step."""
    import threading

    tp, S = 2, 33
    ids = ids_of(ref, S + 1, seed=4)
    x = torch.randn(2, S + 1, ref.section["hc_mult"], ref.cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    shared = {"box": {}, "barrier": threading.Barrier(tp, timeout=120)}  # a failing rank cannot hang the other
    for L in range(ref.cfg.num_layers):
        one = engine_layer(ref, L)
        st = V4LayerState()
        with torch.no_grad():
            want = torch.cat([one(x[:, :S], 0, st, None, None, Group(), ids=ids[:, :S]),
                              one(x[:, S:], S, st, None, None, Group(), ids=ids[:, S:])], 1)
        got = [None] * tp

        def run(rank):
            par = ThreadGroup(rank, tp, shared)
            layer = decoder_layer(ref.cfg, L, par)
            prefix = f"model.layers.{L}."
            resolve_linears(layer, prefix, lambda name: PlainLinear)
            mine = {k: rank_slice(k, v, rank, tp, ref.cfg.n_routed_experts) for k, v in ref.state.items()
                    if k.startswith(prefix)}
            load_unit(layer_unit(L), {prefix: layer}, {k: v for k, v in mine.items() if v is not None})
            state = V4LayerState()
            with torch.no_grad():
                got[rank] = torch.cat([layer(x[:, :S], 0, state, None, None, par, ids=ids[:, :S]),
                                       layer(x[:, S:], S, state, None, None, par, ids=ids[:, S:])], 1)

        threads = [threading.Thread(target=run, args=(r,)) for r in range(tp)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(g is not None for g in got), f"a rank of layer {L} failed"
        errs = [rel(g, want) for g in got]
        print(f"{ref.name} layer {L}: tp 2 vs tp 1 {max(errs):.1e}")
        assert max(errs) < TOL, (L, errs)


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


class ThreadStage(Group):
    """A pipeline stage (tp 1) run as a thread: sends and receives through queues, broadcasts through a box."""

    def __init__(self, rank: int, pp: int, world: dict):
        super().__init__(rank=rank, world=pp, tp=1, pp=pp)
        self.w = world

    def send(self, x, dst: int, wait: bool = True):
        self.w["queues"][(self.rank, dst)].put(x.clone())
        return None if wait else SimpleNamespace(wait=lambda: None)

    def recv(self, shape, dtype, device, src: int):
        x = self.w["queues"][(src, self.rank)].get(timeout=120)
        assert x.shape == shape and x.dtype == dtype, (x.shape, shape)
        return x

    def broadcast_object(self, obj, src: int = 0):
        box, barrier = self.w["box"], self.w["barrier"]
        if self.rank == src:
            box["obj"] = obj
        barrier.wait()
        got = box["obj"]
        barrier.wait()
        return got

    def broadcast(self, x, src: int):
        return x.copy_(self.broadcast_object(x.clone() if self.rank == src else None, src))


def test_pipeline_stages_carry_the_streams(ref, monkeypatch):
    """pp 2 (stages as threads, micro-batched prefill, then decode): the stages send the hc_mult streams, only
    the last one holds hc_head, and the logits are pp 1's."""
    import queue
    import threading

    pp, n = 2, ref.cfg.num_layers
    stages = [list(range(n // 2)), list(range(n // 2, n))]
    ids = ids_of(ref, 40, seed=6)
    one = engine_model_of(ref, monkeypatch)
    want = torch.cat([one.forward(ids[:, :30], cache := one.new_cache(2, 48))]
                     + [one.forward(ids[:, t:t + 1], cache) for t in range(30, 40)], 1)
    world = {"queues": {(a, b): queue.Queue() for a in range(pp) for b in range(pp)}, "box": {},
             "barrier": threading.Barrier(pp, timeout=120)}
    got, heads = [None] * pp, [None] * pp

    def run(rank):
        par = ThreadStage(rank, pp, world)
        model = engine_model.Model(ref.section, "deepseek_v4", par, dtype=torch.float32, stages=stages)
        model.prefill_chunk = 16  # 40 tokens: three micro-batches
        model.take_unit(GLOBALS, {k: v for k, v in ref.state.items() if not k.startswith("model.layers.")})
        for L in range(n):
            model.take_unit(layer_unit(L), {k: v for k, v in ref.state.items() if k.startswith(f"model.layers.{L}.")})
        model.check_complete()
        heads[rank] = model.residual_head is not None
        cache = model.new_cache(2, 48)
        got[rank] = torch.cat([model.forward(ids[:, :30], cache)]
                              + [model.forward(ids[:, t:t + 1], cache) for t in range(30, 40)], 1)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(pp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert heads == [False, True]
    errs = [rel(g, want) for g in got]
    print(f"{ref.name}: pp 2 vs pp 1 {max(errs):.1e}")
    assert max(errs) < TOL, errs


def test_generate_runs_on_the_dense_cache(ref, monkeypatch):
    """engine.generate over the V4 cache: greedy tokens are those a full forward of the whole text picks; a
    cache cannot be cut back (the compressors do not rewind), only reset."""
    from engine.generate import Sampling, generate
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
