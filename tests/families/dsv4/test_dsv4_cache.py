"""DeepSeek-V4's long-context cache (engine/models/deepseek_v4/cache.py, v4_store.py, v4_format.py): its rows' byte layouts, its
bytes against plan's exact formula at lengths that are not multiples of the rates, what a long prefill leaves
behind, and --kv-dtype's logits (chunking changes nothing; 8-bit stays close to the compute-dtype cache)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.cache.latent import KVOptions
from engine.models.deepseek_v4.entry_format import EntryFormat, key_format
from kconvert.kv_rows import KV_DTYPES
from kconvert.plan.kv_bytes import kv_bytes
from test_dsv4_layers import engine_model_of, ids_of
from dsv4_reference import CONFIGS, engine_state, reference, text_config

pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def ref(request):
    model, section = reference(request.param, seed=3)
    return SimpleNamespace(name=request.param, model=model, section=section, cfg=text_config(section),
                           state=engine_state(model))


def test_entry_rows_are_the_serving_layout():
    """At the release shape (512 values, the last 64 RoPE): fp8 is 448 e4m3 + 128 B bf16 RoPE + 7 ue8m0 scale
    bytes + 1 pad = 584 B; indexer keys 128 e4m3 + a float32 scale = 132 B. Round trips: the RoPE part exact to
    bf16, fp8 scales powers of two with no value saturating, int8 finer than fp8."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    x = torch.randn(3, 5, 512, generator=g) * torch.logspace(-3, 2, 512)  # tiles of very different ranges
    sizes = {code: EntryFormat(512, 64, code, torch.float32).row_bytes for code in ("bf16", "fp8", "int8")}
    assert sizes == {"bf16": 1024, "fp8": 584, "int8": 608}
    assert key_format(128, "fp8", torch.float32).row_bytes == 132
    errs = {}
    for code in ("fp8", "int8"):
        fmt = EntryFormat(512, 64, code, torch.float32)
        rows = fmt.encode(x)
        assert rows.dtype == torch.uint8 and rows.shape == (3, 5, sizes[code])
        back = fmt.decode(rows, torch.float32)
        assert torch.equal(back[..., 448:], x[..., 448:].bfloat16().float())
        tiles = (back - x)[..., :448].unflatten(-1, (7, 64))
        ref_tiles = x[..., :448].unflatten(-1, (7, 64))
        errs[code] = (tiles.norm(dim=-1) / ref_tiles.norm(dim=-1)).max().item()
    fp8 = EntryFormat(512, 64, "fp8", torch.float32)
    exps = fp8.encode(x)[..., 448 + 128:448 + 128 + 7].float() - 127
    amax = x[..., :448].unflatten(-1, (7, 64)).abs().amax(-1)
    assert (amax <= 448 * torch.exp2(exps)).all() and (amax > 224 * torch.exp2(exps)).all()  # smallest power of 2
    assert errs["fp8"] < 0.07 and errs["int8"] < 0.02, errs


def _lengths_and_bytes(model, section, kv_dtype, batch: int = 2):
    """(length, engine bytes in use, engine bytes allocated) after uneven prefill chunks and single tokens."""
    cache = model.new_cache(batch, 64, kv=KVOptions(kv_dtype))
    ids = torch.randint(0, model.cfg.vocab_size, (batch, 37), generator=torch.Generator().manual_seed(11))
    out, at = [], 0
    for n in (1, 4, 8, 1, 23):  # lengths 1, 5, 13, 14, 37
        model.forward(ids[:, at:at + n], cache)
        at += n
        out.append((at, cache.bytes_in_use(), cache.nbytes()))
    return out


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_cache_bytes_equal_plan(ref, monkeypatch, kv_dtype):
    """Engine bytes = batch x plan's context_bytes(L) (sliding windows, compressor state, entries and indexer
    keys) at every length; allocated storage at most 25 % + a page per store over it."""
    model = engine_model_of(ref, monkeypatch)
    plan = kv_bytes(ref.section, kv_dtype)
    for length, used, allocated in _lengths_and_bytes(model, ref.section, kv_dtype):
        assert used == 2 * plan.context_bytes(length), (length, used, plan)
        assert used <= allocated <= 1.25 * used + 3 * ref.cfg.num_layers * 64 * 2 * 2 * ref.section["head_dim"]
    assert plan.per_sequence > 0 and plan.context_bytes(0) == 0
    assert plan.max_context(2 * plan.context_bytes(1000), 2) in range(1000, 1000 + 2 * max(
        t[0] for t in plan.layer_terms))  # inverts context_bytes up to the entries' granularity


def test_a_long_prefill_leaves_only_the_cache(ref, monkeypatch):
    """After a prefill in one call, every tensor the cache holds owns its storage (no view keeps the call's
    projections alive) and the storage is the cache's own count; entries are L // rate per compressor."""
    model = engine_model_of(ref, monkeypatch)
    cache = model.new_cache(1, 400)
    model.forward(ids_of(ref, 301)[:1], cache)
    held = 0
    for L, st in enumerate(cache.layers):
        comp = [s for s in (st.compressor, st.indexer) if s.store is not None]
        tensors = [st.ring.rows] + [s.store.rows for s in comp] + [t for s in comp for t in s.tensors()]
        for t in tensors:
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), (L, t.shape)
        held += sum(t.numel() * t.element_size() for t in tensors)
        rate = model.layer(L).self_attn.rate
        assert all(s.count == 301 // rate for s in comp)
        assert st.ring.rows.shape[1] == ref.section["sliding_window"] - 1
    assert held == cache.nbytes()


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8", "int8", "fp8-ds"])
def test_kv_dtype_logits(ref, monkeypatch, kv_dtype):
    """With a --kv-dtype the logits do not depend on how the text is chunked (attention always sees the rows
    as the cache gives them back), and stay close to the compute-dtype cache's."""
    model = engine_model_of(ref, monkeypatch)
    ids = ids_of(ref, 40, seed=int(torch.randint(0, 1 << 30, ())))
    base = model.forward(ids).log_softmax(-1)
    whole = model.forward(ids, model.new_cache(2, 40, kv=KVOptions(kv_dtype))).log_softmax(-1)
    cache = model.new_cache(2, 40, kv=KVOptions(kv_dtype))
    cuts = [0, 11, 19, 20, 21, 40]  # single tokens where decode reads only the chosen CSA entries
    parts = [model.forward(ids[:, a:b], cache) for a, b in zip(cuts, cuts[1:])]
    chunked = torch.cat(parts, 1).log_softmax(-1)
    kld = lambda p, q: (p.exp() * (p - q)).sum(-1).mean().item()  # noqa: E731
    # float32 roundoff between chunkings can flip a row's rounding: ~1e-8 here; in-chunk keys unrounded: ~1e-3
    assert abs(kld(whole, chunked)) < 1e-6
    assert 0 < kld(base, whole) < 5e-2  # the random tiny models are touchy (as the MLA cache's test says)


def test_host_tier_fetches_only_the_chosen_entries(ref, monkeypatch):
    """--kv-device-budget: CSA entries in host memory; a decode step copies exactly index_topk rows per CSA layer
    and sequence, the logits equal the flat cache's bit for bit, and the device part is held to the budget."""
    from engine.models.deepseek_v4.config import CSA
    from kconvert.errors import EngineError

    model = engine_model_of(ref, monkeypatch)
    ids = ids_of(ref, 33, seed=int(torch.randint(0, 1 << 30, ())))
    flat = model.new_cache(2, 36, kv=KVOptions("fp8"))
    tier = model.new_cache(2, 36, kv=KVOptions("fp8", device_budget=1 << 30))
    logits = {}
    for name, cache in (("flat", flat), ("tier", tier)):
        logits[name] = [model.forward(ids[:, :28], cache)]
        steps = []
        for t in range(28, 33):
            before = cache.fetched()
            logits[name].append(model.forward(ids[:, t:t + 1], cache))
            steps.append(cache.fetched() - before)
    assert torch.equal(torch.cat(logits["tier"], 1), torch.cat(logits["flat"], 1))
    csa = sum(model.layer(L).self_attn.kind == CSA for L in range(ref.cfg.num_layers))
    row = tier.layers[0].entry_format(ref.section["head_dim"], ref.section["qk_rope_head_dim"], torch.float32).row_bytes
    assert steps == [2 * csa * ref.section["index_topk"] * row] * 5 and flat.fetched() == 0
    assert 0 < tier.device_bytes() < tier.bytes_in_use() == flat.bytes_in_use()
    plan = kv_bytes(ref.section, "fp8")
    assert tier.device_bytes() == 2 * plan.context_bytes(33, "device")  # plan's host-tier split, exactly
    small = model.new_cache(2, 36, kv=KVOptions("fp8", device_budget=tier.device_bytes() // 2))
    with pytest.raises(EngineError, match="--kv-device-budget"):
        model.forward(ids, small)


def test_a_long_prefill_runs_in_blocks_of_queries(ref, monkeypatch):
    """Score tensors bounded to a few thousand elements: the prompt runs in blocks of a few queries, with the
    logits of one block (the reference-matched path)."""
    from engine.models.deepseek_v4.attention import V4Attention

    model = engine_model_of(ref, monkeypatch)
    ids = ids_of(ref, 40, seed=int(torch.randint(0, 1 << 30, ())))
    whole = model.forward(ids)
    monkeypatch.setattr(V4Attention, "block_elements", 2000)
    assert model.layer(0).self_attn._block(0, 2, 40) < 40
    assert (model.forward(ids) - whole).abs().max() < 1e-5 * whole.abs().max()
