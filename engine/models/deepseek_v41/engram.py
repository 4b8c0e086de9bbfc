"""DeepSeek-V4.1's Engram: an n-gram lookup written into the residual streams, gated by how well it matches them.

Hashing (EngramHashes): each token's compressed id (engram_tokens.py) and those of the `max_ngram - 1` tokens before
it form the 2- ... max_ngram-grams ending there; look-back stops at the sequence start and at image tokens (`DEAD`),
where the pad token's id stands in. Each n-gram is hashed per layer by XOR of id x multiplier (one odd multiplier per
(layer, look-back), drawn by numpy's PCG64 seeded 10007 x layer, as the reference draws them), then reduced modulo a
prime per (n-gram, head): each (n-gram, head) owns its own prime-sized range of the layer's table (primes handed out
in order, never twice). A layer looks up (max_ngram - 1) x heads rows.

Engram (the module, kind of layer part `engram`): `embed` [rows, head_dim] (the table; split by rows over tp ranks,
a rank's lookups summed over the group), `wkv` [(hc + 1) hidden, rows_looked_up x head_dim] -> one key per stream and
a shared value; gate = sigmoid(signed sqrt(<h, q_weight * k_weight * key> / (rms(h) rms(key) sqrt(hidden)))) per
stream, shut on image tokens; streams += gate x value."""

from __future__ import annotations

import torch
from torch import nn

from engine.models.deepseek_v41.cache import DEAD
from engine.layers.linear import LinearSlot
from engine.layers.slots import slot
from kconvert.distributed import Group
from kconvert.errors import CheckpointError
from kconvert.family.v41_rules import table_primes  # noqa: F401 (also the fixtures' API)

GATE_FLOOR = 1e-6  # |score| is floored here before its square root (the reference's clamp)


def hash_multipliers(layer_ids: list[int], max_ngram: int, compressed_vocab: int) -> torch.Tensor:
    """[layers, max_ngram] int64: odd multipliers small enough that id x multiplier cannot overflow int64."""
    import numpy as np

    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab) // 2)
    rows = [np.random.default_rng(10007 * L).integers(0, bound, size=(max_ngram,), dtype=np.int64) * 2 + 1
            for L in layer_ids]
    return torch.from_numpy(np.stack(rows))


class EngramHashes:
    """Token ids -> every Engram layer's row numbers, given the compressed-id map (engram_token_map.json)."""

    def __init__(self, c, token_map: list[int]):
        self.max_ngram, self.heads = c.engram_max_ngram, c.engram_heads
        self.token_map = torch.tensor(token_map, dtype=torch.long)
        vocab = int(self.token_map.max()) + 1
        if vocab != c.engram_compressed_vocab:
            raise CheckpointError(f"engram_token_map.json has {vocab} compressed ids, the config says "
                                  f"{c.engram_compressed_vocab}: the hashes would read the wrong rows", file="config.json")
        if not 0 <= c.engram_pad_token < len(token_map):
            raise CheckpointError(f"engram_pad_token_id {c.engram_pad_token} is not a token", file="config.json")
        self.pad = int(self.token_map[c.engram_pad_token])
        primes = table_primes(c.engram_vocab, len(c.engram_layers), self.max_ngram - 1, self.heads)
        for L, sizes, rows in zip(c.engram_layers, primes, c.engram_rows):
            if sum(sizes) != rows:
                raise CheckpointError(f"engram_num_embeddings of layer {L} is {rows}; its {len(sizes)} prime ranges "
                                      f"from engram_vocab_size {c.engram_vocab} hold {sum(sizes)} rows", file="config.json")
        self.primes = torch.tensor(primes, dtype=torch.long)  # [layers, (ngram, head)]
        self.offsets = torch.cumsum(torch.nn.functional.pad(self.primes, (1, 0))[:, :-1], dim=1)
        self.multipliers = hash_multipliers(c.engram_layers, self.max_ngram, vocab)

    def compress(self, ids: torch.Tensor, live: torch.Tensor | None) -> torch.Tensor:
        """Compressed ids [B, S] (DEAD where `live` is False: image tokens)."""
        out = self.token_map.to(ids.device)[ids.clamp(0, len(self.token_map) - 1)]
        return out if live is None else out.masked_fill(~live, DEAD)

    def rows(self, history: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
        """history [B, max_ngram - 1] (the compressed ids before `current`, DEAD where none), current [B, S] ->
        [B, S, layers, (max_ngram - 1) x heads] table rows."""
        seq = torch.cat([history, current], 1)
        n, S = self.max_ngram, current.shape[1]
        back = history.shape[1]
        tokens, blocked = [], torch.zeros_like(current, dtype=torch.bool)
        for shift in range(n):
            t = seq[:, back - shift:back - shift + S]
            blocked = blocked | (t == DEAD)
            tokens.append(t.masked_fill(blocked, self.pad))
        tokens = torch.stack(tokens, -1)  # [B, S, n]
        mult = self.multipliers.to(current.device)
        products = tokens[:, :, None, :] * mult[None, None]  # [B, S, layers, n]
        primes = self.primes.to(current.device).view(len(mult), n - 1, self.heads)
        rolling, cols = products[..., 0], []
        for i in range(1, n):
            rolling = torch.bitwise_xor(rolling, products[..., i])
            cols.append(rolling[..., None] % primes[:, i - 1])
        return torch.cat(cols, -1) + self.offsets.to(current.device)


class EngramTable(nn.Module):
    """`weight` [rows of this rank, head_dim] (+ `weight_scale`, the release's FP8 rows' scales, which conversions
    keep: quant/fp8_rows.py): the rank holds rows [start, start + len) of the table; lookups elsewhere are zero here
    and summed over the tp group."""

    def __init__(self, rows: int, par: Group, group: int = 32):
        super().__init__()
        self.per_rank = -(-rows // par.tp)
        self.start = par.tp_rank * self.per_rank
        self.group = group
        slot(self, "weight")
        slot(self, "weight_scale", optional=True)

    def forward(self, index: torch.Tensor, dtype: torch.dtype, par: Group) -> torch.Tensor:
        """index [...] of table rows -> [..., head_dim] in `dtype`."""
        n = self.weight.shape[0]
        local = index - self.start
        here = (local >= 0) & (local < n)
        local = local.clamp(0, max(n - 1, 0))
        rows = self.weight[local.to(self.weight.device)]
        if self.weight_scale is not None:  # FP8 e4m3 rows, one e8m0 scale per `group` values
            s = self.weight_scale[local.to(self.weight_scale.device)].float()
            rows = (rows.float().unflatten(-1, (-1, self.group)) * s[..., None]).flatten(-2)
        rows = rows.to(dtype) * here[..., None].to(dtype)
        return par.all_reduce(rows) if par.tp > 1 else rows


class Engram(nn.Module):
    """`embed` (EngramTable), `wkv` (replicated), `q_weight`, `k_weight` [hc, hidden]."""

    def __init__(self, c, rows: int, par: Group):
        super().__init__()
        self.hidden, self.hc, self.eps = c.hidden, c.hc_mult, c.eps
        self.embed = EngramTable(rows, par)
        self.wkv = LinearSlot()
        slot(self, "q_weight")
        slot(self, "k_weight")

    def forward(self, streams: torch.Tensor, rows: torch.Tensor, live: torch.Tensor | None, par: Group) -> torch.Tensor:
        """streams [B, S, hc, hidden], rows [B, S, cols] (this layer's), live [B, S] (False: image tokens)."""
        B, S = rows.shape[:2]
        looked = self.embed(rows, streams.dtype, par).view(B, S, -1)
        kv = self.wkv(looked)
        key = kv[..., :self.hc * self.hidden].float().view(B, S, self.hc, self.hidden)
        value = kv[..., self.hc * self.hidden:].float()
        h = streams.float()
        weight = self.q_weight.float() * self.k_weight.float()
        rstd = torch.rsqrt(h.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)
        dot = (h * weight * key).sum(-1) * rstd * self.hidden ** -0.5
        root = dot.abs().clamp_min(GATE_FLOOR).sqrt()
        gate = torch.sigmoid(torch.where(dot >= 0, root, -root))  # [B, S, hc]
        if live is not None:
            gate = gate * live[..., None].to(gate.dtype)
        return (h + gate[..., None] * value[:, :, None, :]).to(streams.dtype)
