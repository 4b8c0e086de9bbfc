"""The paged / quantized / tiered KV cache (engine/cache/latent.py, kv_format.py, kv_tier.py): pages taken and
returned, ragged batches equal per-sequence runs, bf16/fp8 rows round-trip, the host tier changes no
logit, and the engine's bytes per token are plan's."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from kconvert.errors import EngineError

torch.set_num_threads(2)


@pytest.fixture(scope="module")
def model(conversion):
    from engine.model import Model

    return Model.from_converted(conversion("tiny-k25-dsv32", tp=1), dtype=torch.float32)


@pytest.fixture
def dense(model):
    """The same model without its indexer: the deepseek_v3 path (full attention, full reads)."""
    saved = [l.self_attn.indexer for l in model.layers.values()], model.cfg
    for l in model.layers.values():
        l.self_attn.indexer = None
    model.cfg = dataclasses.replace(model.cfg, index_topk=0)
    yield model
    for l, ix in zip(model.layers.values(), saved[0]):
        l.self_attn.indexer = ix
    model.cfg = saved[1]


def _ids(n, seed):
    return torch.randint(0, 768, (1, n), generator=torch.Generator().manual_seed(seed))


def test_pages_taken_on_demand_returned_and_bounded(model):
    from engine.cache.latent import PAGE, KVCache, KVOptions

    per_token = KVCache(model.cfg, 1, 10, torch.float32).bytes_per_token
    cache = KVCache(model.cfg, 2, 1 << 20, torch.float32, kv=KVOptions(budget=5 * PAGE * per_token))
    assert cache.nbytes() == 0 and cache.max_pages == 5  # a 1M-token limit allocates nothing up front
    cache.commit(cache.begin(PAGE + 1, seqs=[0]))
    cache.commit(cache.begin(3, seqs=[1]))
    assert cache.tables[0] == [0, 1] and cache.tables[1] == [2] and cache.lengths == [PAGE + 1, 3]
    cache.release(0)
    assert cache.pages_in_use == 1 and sorted(cache.free_ids) == [0, 1]
    cache.commit(cache.begin(2 * PAGE, seqs=[1]))  # 3 tokens -> 131: two more pages, the freed ones
    assert sorted(cache.tables[1][1:]) == [0, 1] and cache.pages_in_use == 3
    cache.commit(cache.begin(2 * PAGE, seqs=[0]))
    with pytest.raises(EngineError, match="budget"):
        cache.begin(1, seqs=[0])  # 6th page: over the budget
    cache.length = 10  # truncation gives pages back too
    assert cache.tables == [[cache.tables[0][0]], [cache.tables[1][0]]]


@pytest.mark.parametrize("code", ["bf16", "fp8", "int8"])
@pytest.mark.parametrize("width", [200, 256])  # a partial last tile, and whole tiles (the broadcast decode)
def test_rows_round_trip(code, width):
    from engine.cache.row_format import RowFormat
    from kconvert.kv_rows import row_bytes
    from kconvert.plan.kv_bytes import latent_bytes

    g = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    lat = torch.randn(3, 5, width, generator=g) * torch.logspace(-3, 2, width)  # tiles of very different range
    rope = torch.randn(3, 5, 64, generator=g)
    fmt = RowFormat(width, 64, code, torch.float32)
    rows = fmt.encode(lat, rope)
    assert rows.shape == (3, 5, latent_bytes(width, 64, code)) and rows.dtype == torch.uint8
    assert RowFormat(96, 0, code, torch.float32).row_bytes == row_bytes(96, code)
    got, got_rope = fmt.decode(rows, torch.float32)
    assert torch.equal(got_rope, rope.to(torch.bfloat16).float())
    if code == "bf16":
        assert torch.equal(got, lat.to(torch.bfloat16).float())
        return
    for t0 in range(0, width, 128):  # independently, per 128-value tile: scale = amax / qmax, x / scale coded
        x = lat[..., t0:t0 + 128]
        if code == "fp8":
            s = x.abs().amax(-1, keepdim=True) / 448
            assert torch.equal(got[..., t0:t0 + 128], (x / s).to(torch.float8_e4m3fn).float() * s)
            assert ((got[..., t0:t0 + 128] - x).abs() <= x.abs() / 16 + s / 2 ** 6).all()
        else:
            s = x.abs().amax(-1, keepdim=True) / 127
            torch.testing.assert_close(got[..., t0:t0 + 128], torch.round(x / s) * s, rtol=1e-6, atol=0)
            assert ((got[..., t0:t0 + 128] - x).abs() <= s * (0.5 + 1e-5)).all()


@pytest.mark.parametrize("width", [260, 132, 66, 33])  # rows of 8-, 4-, 2- and 1-byte words
def test_row_gather_equals_indexing(width):
    from engine.cache.tier import take_rows

    g = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    t = torch.randint(0, 256, (300, width), dtype=torch.uint8, generator=g)
    rows = torch.randint(0, 300, (2, 7, 5), generator=g)
    assert torch.equal(take_rows(t, rows), t[rows])


def _greedy_run(model, cache, ids, steps, seqs=None):
    logits = [model.forward(ids, cache, seqs=seqs)[:, -1]]
    for _ in range(steps):
        logits.append(model.forward(logits[-1].argmax(-1, keepdim=True), cache, seqs=seqs)[:, -1])
    return torch.stack(logits, 1)


@pytest.mark.parametrize("kv_dtype", [None, "fp8-ds"])
def test_ragged_batch_equals_per_sequence(model, kv_dtype):
    from engine.cache.latent import KVOptions

    kv = KVOptions(kv_dtype)
    lengths, steps = [5, 70, 23], 2
    prompts = [_ids(n, 100 + n) for n in lengths]
    alone = [_greedy_run(model, model.new_cache(1, 128, kv=kv), p, steps)[0] for p in prompts]
    cache = model.new_cache(3, 128, kv=kv)
    first = [model.forward(p, cache, seqs=[b])[0, -1] for b, p in enumerate(prompts)]
    tok = torch.stack(first).argmax(-1, keepdim=True)
    batched = [torch.stack(first)]
    for _ in range(steps):  # one decode step for all three, each at its own position
        batched.append(model.forward(tok, cache)[:, -1])
        tok = batched[-1].argmax(-1, keepdim=True)
    batched = torch.stack(batched, 1)
    assert cache.lengths == [n + steps for n in lengths]
    for b in range(3):
        torch.testing.assert_close(batched[b], alone[b], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kv_dtype,path", [(None, "dsa"), ("fp8-ds", "dsa"), ("int8", "dsa"), ("bf16", "dense")])
def test_host_tier_changes_no_logit(model, kv_dtype, path, request):
    from engine.cache.latent import PAGE, KVOptions

    m = request.getfixturevalue("dense") if path == "dense" else model
    ids, steps = _ids(4 * PAGE + 8, 7), 5
    flat = m.new_cache(1, 320, kv=KVOptions(kv_dtype))
    ref = _greedy_run(m, flat, ids, steps)
    per_page = PAGE * flat.latent_bytes_per_token
    tiered = m.new_cache(1, 320, kv=KVOptions(kv_dtype, device_budget=4 * per_page))
    prefill = m.forward(ids, tiered)[:, -1]
    stats = tiered.placement.stats
    assert stats.evicted_bytes > 0 and tiered.placement.dev_next == 3  # 3 newest pages + 1 cached host page
    moved = stats.moved_bytes
    out = [prefill]
    for _ in range(steps):
        out.append(m.forward(out[-1].argmax(-1, keepdim=True), tiered)[:, -1])
    assert torch.equal(torch.stack(out, 1), ref)
    per_step = (stats.moved_bytes - moved) / steps
    full = 4 * PAGE * flat.latent_bytes_per_token
    if path == "dsa":  # only selected rows cross: at most index_topk per layer and step
        assert 0 < per_step <= m.cfg.index_topk * flat.latent_bytes_per_token < full
    else:
        assert per_step >= PAGE * flat.latent_bytes_per_token  # full reads of the host pages


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8", "int8", "fp8-ds"])
def test_measured_bytes_per_token_equal_plan(model, kv_dtype):
    from engine.cache.latent import PAGE, KVOptions
    from kconvert.plan.kv_bytes import kv_bytes

    plan = kv_bytes(model.mc.raw.get("text_config", model.mc.raw), kv_dtype).per_token
    cache = model.new_cache(1, 4 * PAGE, kv=KVOptions(kv_dtype))
    model.forward(_ids(2 * PAGE, 3), cache)  # exactly two pages: storage holds exactly 128 tokens
    assert cache.nbytes() == 2 * PAGE * plan == cache.bytes_in_use()
    if kv_dtype != "bf16":  # the latent proper (rope part aside): e4m3 + a float32 per 128 vs bf16
        r = model.cfg.kv_lora_rank
        assert 2 * r / (cache.lat_fmt.row_bytes - 2 * model.cfg.qk_rope_head_dim) == 2 * r / (r + 4 * math.ceil(r / 128)) > 1.9


@pytest.mark.parametrize("kv_dtype", ["fp8", "int8", "fp8-ds"])
def test_8bit_kv_logits_close_to_native(model, kv_dtype):
    from engine.cache.latent import KVOptions

    ids = _ids(96, int(torch.randint(0, 1 << 30, ())))
    base = model.forward(ids, model.new_cache(1, 96)).log_softmax(-1)
    q = model.forward(ids, model.new_cache(1, 96, kv=KVOptions(kv_dtype))).log_softmax(-1)
    kld = (base.exp() * (base - q)).sum(-1).mean()
    assert 0 < float(kld) < 0.05  # the random tiny model is touchy: bf16 KV alone adds ~2e-3 here


def test_tier_reads_equal_flat_reads_under_cache_churn(model):
    """Random row sets read through a tier whose page cache is far smaller than the host side (pages
    evicted and refilled, rows cached partly) return the flat cache's bytes; a repeated read moves nothing."""
    from engine.cache.latent import PAGE, KVOptions

    seed = int(torch.randint(0, 1 << 30, ()))
    g = torch.Generator().manual_seed(seed)
    c = model.cfg
    caches = []
    for budget in (None, 8):  # 8 pages on the device: 6 resident, 2 caching host pages
        kv = KVOptions("bf16")
        probe = model.new_cache(1, 40 * PAGE, kv=kv)
        kv.device_budget = None if budget is None else budget * PAGE * probe.latent_bytes_per_token
        caches.append(model.new_cache(1, 40 * PAGE, kv=kv))
    for s0 in range(0, 30 * PAGE, 7 * PAGE):  # ragged chunks through the normal write path
        S = min(7 * PAGE, 30 * PAGE - s0)
        lat, rope = torch.randn(1, S, c.kv_lora_rank, generator=g), torch.randn(1, S, c.qk_rope_head_dim, generator=g)
        for cache in caches:
            step = cache.begin(S)
            for layer in cache.layers:
                layer.write(step, lat, rope)
            cache.commit(step)
    flat, tiered = caches
    stats = tiered.placement.stats
    for i in range(40):
        pages = torch.randint(0, 30, (2,), generator=g)  # at most 2 host pages: served through the cache
        rows = (pages[:, None] * PAGE + torch.randint(0, PAGE, (2, 8), generator=g)).view(1, 16)
        layer = i % c.num_layers
        want = flat.layers[layer].tier.gather(_logical(flat, rows))
        got = tiered.layers[layer].tier.gather(_logical(tiered, rows))
        assert torch.equal(got, want), f"seed {seed}, read {i}"
        before = stats.fetched_bytes
        assert torch.equal(tiered.layers[layer].tier.gather(_logical(tiered, rows)), want)
        assert stats.fetched_bytes == before  # the same rows again: all cached
    wide = torch.arange(30 * PAGE)[None]  # every page: more host pages than the cache, read straight through
    assert torch.equal(tiered.layers[0].tier.gather(_logical(tiered, wide)), flat.layers[0].tier.gather(_logical(flat, wide)))


def _logical(cache, positions):
    """Logical rows of sequence 0's positions (its page table)."""
    from engine.cache.latent import PAGE

    table = torch.tensor(cache.tables[0])
    return table[positions // PAGE] * PAGE + positions % PAGE
