"""DeepSeek-V4.1's rules between config keys, in one place for the engine (engine/models/deepseek_v41/config.py,
engram.py) and for bind time (config_checks.py): a config whose layer roles do not line up, or whose Engram table
sizes disagree with the prime ranges they hold, is refused by inspect and shard, not after a conversion by the
engine.

Roles: only `kv_source_layer_ids` compute compressed entries, every other compressed layer reads those of the last
source at or before it. Only `index_source_layer_ids` run an indexer; an indexer scores the keys of the last layer at
or before it that is both a KV source and an indexer, and a compressed layer without an indexer attends to the
entries the last indexer at or before it chose. Indexers after `candidate_source_layer_id` score only inside the
blocks of entries that layer's indexer found best (both references, mlx-vlm's and mlx-lm's deepseek_v41, read the
state so; `roles` below says what they cannot run).

Engram tables: each (n-gram, head) of a layer owns a prime-sized range of its table, primes handed out in order
from `engram_vocab_size` up, never twice (mlx-vlm's engram.py); `engram_num_embeddings` of a layer is their sum."""

from __future__ import annotations

from kconvert.errors import ManifestError

MAX_ENGRAM_RANGES = 1 << 16  # (layers x (max n-gram - 1) x heads) prime ranges; V4.1-Flash: 2 x 3 x 8 = 48


def _last(layers, upto: int) -> int | None:
    return max((j for j in layers if j <= upto), default=None)


def roles(ratios: list[int], sources: set, indexers: set, candidate: int, *, prefix: str = "",
          file: str = "config.json"):
    """(entries_from, choice_from, keys_from, the candidate source in effect) per layer, as both references (mlx-vlm's
    and mlx-lm's deepseek_v41) read their shared state, "the last one written": a compressed layer attends to the
    entries of the last KV source at or before it, through the choice of the last indexer at or before it, which
    scored the keys of the last source at or before it that also indexes. A choice is a set of entry positions, so
    the entries and the keys need not come from one layer, only from one rate. Where nothing is there to read (no
    source, no indexer, an indexer with no keys) the layer attends to its window alone, as the references do.
    ManifestError, in one line, where the references cannot run a config, would not compute a causal model from it,
    or would silently ignore a key (a candidate source that runs no indexer)."""
    def bad(what: str) -> ManifestError:
        return ManifestError(f"{what} (DeepSeek-V4.1 layer roles: docs/LIMITS.md)", file=file)

    n = len(ratios)
    for role, layers in (("kv_source_layer_ids", sources), ("index_source_layer_ids", indexers)):
        idle = sorted(j for j in layers if not ratios[j])
        if idle:
            raise bad(f"{prefix}{role} names layer {idle[0]}, which compresses nothing ({prefix}compress_ratios"
                      f"[{idle[0]}] = 0): the references build a compressor / indexer there that never runs")
    if candidate >= 0 and candidate not in indexers:
        raise bad(f"{prefix}candidate_source_layer_id = {candidate}: layer {candidate} runs no indexer (not in "
                  f"{prefix}index_source_layer_ids); the references would ignore it")
    owners = {j for j in indexers if j in sources}  # indexers that project their own keys
    entries, choice, keys = [None] * n, [None] * n, [None] * n
    for L in range(n):
        if L in indexers:
            keys[L] = _last(owners, L)
            if keys[L] is None and _last(sources, L) is not None:
                raise bad(f"{prefix}index_source_layer_ids: indexer {L} has entries to score but no KV source at or "
                          "before it projects index keys (a layer in both kv_source_layer_ids and "
                          "index_source_layer_ids)")
        if ratios[L]:
            entries[L], choice[L] = _last(sources, L), _last(indexers, L)
    candidate = candidate if candidate in indexers and keys[candidate] is not None else -1
    for L in range(n):
        T = choice[L]
        if T is None or keys[T] is None:
            continue  # the window alone
        used = {"its own": L, f"KV source {entries[L]}'s": entries[L], f"indexer {T}'s": T,
                f"key owner {keys[T]}'s": keys[T]}
        if 0 <= candidate < L and L in indexers:
            used[f"candidate source {candidate}'s keys'"] = keys[candidate]
        rates = {what: ratios[j] for what, j in used.items()}
        if len(set(rates.values())) > 1:
            said = ", ".join(f"{what} {r}" for what, r in rates.items())
            raise bad(f"{prefix}compress_ratios: layer {L} reads compressed state made at other rates ({said}): the "
                      "references would index one rate's entries by another's positions")
    return tuple(entries), tuple(choice), tuple(keys), candidate


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin (exact below 3.3 x 10^24, far past any table): cheap for 10^9-sized ranges, where
    trial division would take seconds per prime."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
    for p in small:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def table_primes(vocab: int, layers: int, ngrams: int, heads: int) -> list[list[int]]:
    """Per Engram layer, its (n-gram, head) range sizes, n-gram major: every n-gram length searches up from
    vocab - 1 for the next prime not handed out before."""
    seen: set[int] = set()
    out = []
    for _ in range(layers):
        sizes = []
        for _ in range(ngrams):
            p = vocab - 1
            for _ in range(heads):
                p += 1
                while not is_prime(p) or p in seen:
                    p += 1
                seen.add(p)
                sizes.append(p)
        out.append(sizes)
    return out


def check_engram_rows(layer_ids: list[int], rows: list, vocab: int, max_ngram: int, heads: int, *, prefix: str = "",
                      file: str = "config.json") -> list[list[int]]:
    """The prime ranges of every Engram layer (table_primes), each layer's `engram_num_embeddings` their sum."""
    count = len(layer_ids) * (max_ngram - 1) * heads
    if count > MAX_ENGRAM_RANGES:
        raise ManifestError(f"{prefix}engram_layer_ids x (engram_max_ngram_size - 1) x engram_n_heads = {count} hashed "
                            f"ranges: over the {MAX_ENGRAM_RANGES} kconvert computes (docs/LIMITS.md)", file=file)
    if len(rows) < len(layer_ids):
        raise ManifestError(f"{prefix}engram_num_embeddings has {len(rows)} entries for {len(layer_ids)} Engram layers "
                            f"({prefix}engram_layer_ids)", file=file)
    primes = table_primes(vocab, len(layer_ids), max_ngram - 1, heads)
    for L, sizes, n in zip(layer_ids, primes, rows):
        if sum(sizes) != n:
            raise ManifestError(f"{prefix}engram_num_embeddings = {n} for Engram layer {L}: its {len(sizes)} prime "
                                f"ranges from {prefix}engram_vocab_size {vocab} hold {sum(sizes)} rows", file=file)
    return primes


TOKEN_MAP = "engram_token_map.json"


def read_token_map(root, text: dict, *, prefix: str = "", tokens: int | None = None) -> list[int]:
    """The checkpoint's engram_token_map.json, checked against its config (`text`, the text section; its keys bound
    first) the way the Engram layers read it: a JSON list of compressed ids, one per token of the tokenizer (`tokens`
    where known) and at most `vocab_size`, each in [0, engram_compressed_vocab_size), every id of that range used,
    and `engram_pad_token_id` one of its tokens. The file is opened through the containment rule (io/paths.py): a
    symlink leading out of the directory is refused. shard checks a source's with this before any work, the engine a
    conversion's when it attaches."""
    from pathlib import Path

    from kconvert.errors import CheckpointError, MissingFileError
    from kconvert.io.paths import contained
    from kconvert.io.side_files import MAX_TEXT, read_json

    root = Path(root)
    path = contained(root, TOKEN_MAP, named_in=root / TOKEN_MAP)
    try:
        ids = read_json(path, limit=MAX_TEXT)
    except MissingFileError:
        raise CheckpointError(f"{TOKEN_MAP} is absent: the Engram layers ({prefix}engram_layer_ids) cannot hash their "
                              "n-grams without it (the release ships it beside config.json; shard copies it)",
                              file=str(path)) from None
    compressed, vocab = text.get("engram_compressed_vocab_size"), text.get("vocab_size")
    if not isinstance(ids, list) or not ids:
        raise CheckpointError("must be a non-empty JSON list of compressed token ids", file=str(path))
    bad = next((i for i, v in enumerate(ids) if isinstance(v, bool) or not isinstance(v, int) or v < 0), None)
    if bad is not None:
        raise CheckpointError(f"entry {bad} = {ids[bad]!r:.40}: a compressed id is a non-negative integer", file=str(path))
    if isinstance(vocab, int) and len(ids) > vocab:
        raise CheckpointError(f"{len(ids)} entries: more tokens than {prefix}vocab_size {vocab}", file=str(path))
    if tokens is not None and len(ids) < tokens:
        raise CheckpointError(f"{len(ids)} entries for a tokenizer of {tokens} tokens: the tokens past its end would "
                              "hash as another token", file=str(path))
    top = max(ids)
    if isinstance(compressed, int) and top + 1 != compressed:
        raise CheckpointError(f"{top + 1} compressed ids, {prefix}engram_compressed_vocab_size says {compressed}: the "
                              "hashes would read the wrong rows", file=str(path))
    if len(set(ids)) != top + 1:
        raise CheckpointError(f"compressed ids 0..{top} are not all used (a damaged map)", file=str(path))
    pad = text.get("engram_pad_token_id", 0)
    if isinstance(pad, int) and not 0 <= pad < len(ids):
        raise CheckpointError(f"{prefix}engram_pad_token_id {pad} is not one of its {len(ids)} tokens", file=str(path))
    return ids
