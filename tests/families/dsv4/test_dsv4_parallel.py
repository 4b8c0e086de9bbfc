"""DeepSeek-V4's engine layers under tensor and pipeline parallelism, with ranks as threads of one process
(all-reduce, send / recv and broadcast through shared memory): tp 2 with the V4 slicing rules and pp 2 give
the single-rank results."""

from __future__ import annotations

import queue
import threading
from types import SimpleNamespace

import torch

import engine.model as engine_model
from engine.models.registry import decoder_layer
from engine.layers.linear import PlainLinear, resolve_linears
from engine.layers.slots import load_unit
from engine.models.deepseek_v4.cache import V4LayerState
from kconvert.disk_format.units import GLOBALS, layer_unit
from kconvert.distributed import Group
from test_dsv4_layers import TOL, engine_layer, engine_model_of, ids_of, ref, rel  # noqa: F401 (ref: the fixture)


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
