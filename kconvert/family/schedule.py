"""Per-layer schedules: which kind each layer is, read from config.json in any of its spellings.

DeepSeek-V4 says which attention each layer has either as `compress_ratios` (one rate per layer,
MTP included: 0 / 4 / 128) or as transformers' `layer_types` (one name per decoder layer), and which
layers route by hash as `num_hash_layers` (the first N) or `mlp_layer_types`. A manifest part
declares such a schedule (`[schedules.NAME]`) and its shape expressions read `NAME[L]`, the layer's
kind as an index into `kinds`. When a config has none of the spellings the schedule is an error:
transformers' fallback default is not the released schedule, so guessing would build a wrong model.

    [schedules.attn_kind]
    length = "num_hidden_layers + num_nextn_predict_layers"   # layers scheduled (MTP included)
    kinds = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
    values_key = "compress_ratios"       # a list of `length` numbers; value i of `values` is kind i
    values = ["0", "compress_rates.compressed_sparse_attention", "compress_rates.heavily_compressed_attention"]
    names_key = "layer_types"            # a list of `names_length` kind names
    names_length = "num_hidden_layers"
    count_key = "num_hash_layers"        # the first N layers are kinds[1], the rest kinds[0]
    extra_kind = 0                       # the kind of layers past a names/count list (MTP)

DeepSeek-V4.1 writes one ratio per layer (0, 1 or a pooling width) and may list MTP layers' too:

    values = ["0", "1"]
    other_values_kind = 2                # any other positive integer is this kind
    extra_entries = true                 # entries past `length` (MTP layers) are not read

and lists the layers of a role (`kv_source_layer_ids`, `engram_layer_ids`). A role that numbers its members
(the i-th Engram layer reads the i-th table) is a position schedule: each layer's index in the list, else -1:

    position_in = "engram_layer_ids"

Kimi Linear and Kimi K3 list the layers of each kind instead, counting from 1 (`linear_attn_config`'s
`kda_layers` and `full_attn_layers`):

    members = { kda = "linear_attn_config.kda_layers", mla = "linear_attn_config.full_attn_layers" }
    members_base = 1                     # the lists count layers from 1
    # each layer in exactly one list; a kind whose list is absent takes the layers no list names
"""

from __future__ import annotations

from collections.abc import Mapping

from kconvert.errors import ManifestError
from kconvert.family.expr import evaluate


def _show(v) -> str:
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def read_schedules(specs: Mapping, env: Mapping, *, prefix: str, file: str) -> dict[str, list[int]]:
    """{NAME: [kind index per layer]} for every schedule of a part, or ManifestError naming the field."""
    return {name: _read(name, spec, env, prefix, file) for name, spec in specs.items()}


def _read(name: str, spec: Mapping, env: Mapping, prefix: str, file: str) -> list[int]:
    length = int(evaluate(spec["length"], env))
    if "position_in" in spec:
        return _positions(spec["position_in"], _lookup(env, spec["position_in"]), length, prefix, file)
    kinds = list(spec["kinds"])
    extra = int(spec.get("extra_kind", 0))
    found: list[tuple[str, list[int]]] = []
    key = spec.get("values_key")
    if key and env.get(key) is not None:
        found.append((key, _from_values(env[key], spec, env, length, kinds, prefix + key, file)))
    key = spec.get("names_key")
    if key and env.get(key) is not None:
        n = int(evaluate(spec.get("names_length", spec["length"]), env))
        found.append((key, _from_names(env[key], kinds, n, length, extra, prefix + key, file)))
    key = spec.get("count_key")
    if key and env.get(key) is not None:
        count = env[key]
        if not _is_int(count) or not 0 <= count <= length:
            raise ManifestError(f"{prefix}{key} = {_show(count)}: must be an integer in [0, {length}]", file=file)
        found.append((key, [1] * count + [extra] * (length - count)))
    members = {kind: (path, _lookup(env, path)) for kind, path in (spec.get("members") or {}).items()}
    if any(value is not None for _, value in members.values()):
        field = " / ".join(prefix + path for path, value in members.values() if value is not None)
        found.append((field, _from_members(members, kinds, length, int(spec.get("members_base", 0)), prefix, file)))
    if not found:
        spellings = " or ".join([prefix + spec[k] for k in ("values_key", "count_key", "names_key") if spec.get(k)]
                                + [prefix + path for path, _ in members.values()])
        raise ManifestError(f"config has no {spellings}: the {name} of each layer is unknown (a default would not be "
                            "the released schedule)", file=file)
    (first, kinds_of), *others = found
    for other, theirs in others:
        for layer, (a, b) in enumerate(zip(kinds_of, theirs)):
            if a != b:
                raise ManifestError(f"{prefix}{first} and {prefix}{other} disagree at layer {layer} ({kinds[a]} vs "
                                    f"{kinds[b]})", file=file)
    return kinds_of


def _positions(path: str, layers, length: int, prefix: str, file: str) -> list[int]:
    """Each layer's index in the list at `path` (absent: no layer is listed), else -1."""
    if layers is None:
        return [-1] * length
    if not isinstance(layers, list) or not all(_is_int(v) for v in layers):
        raise ManifestError(f"{prefix}{path} = {_show(layers)}: must be a list of layer numbers", file=file)
    out = [-1] * length
    for i, v in enumerate(layers):
        if not 0 <= v < length:
            raise ManifestError(f"{prefix}{path} names layer {v}: layers are 0..{length - 1}", file=file)
        if out[v] >= 0:
            raise ManifestError(f"{prefix}{path}: layer {v} is listed twice", file=file)
        out[v] = i
    return out


def _from_values(values, spec: Mapping, env: Mapping, length: int, kinds: list, field: str, file: str) -> list[int]:
    if isinstance(values, list) and spec.get("extra_entries") and len(values) > length:
        values = values[:length]
    if not isinstance(values, list) or len(values) != length:
        n = len(values) if isinstance(values, list) else _show(values)
        raise ManifestError(f"{field} has {n} entries, needs {length} ({spec['length']}: one per layer, MTP included)",
                            file=file)
    meaning = {}
    for kind, text in enumerate(spec["values"]):
        meaning.setdefault(evaluate(text, env), kind)
    other = spec.get("other_values_kind")
    out = []
    for i, v in enumerate(values):
        if other is not None and _is_int(v) and v > 0 and v not in meaning:
            out.append(int(other))
            continue
        if not _is_int(v) or v not in meaning:
            allowed = ", ".join(f"{k} ({kinds[m]})" for k, m in meaning.items())
            allowed += f", or another positive integer ({kinds[int(other)]})" if other is not None else ""
            raise ManifestError(f"{field}[{i}] = {_show(v)}: must be one of {allowed}", file=file)
        out.append(meaning[v])
    return out


def _from_names(names, kinds: list, n: int, length: int, extra: int, field: str, file: str) -> list[int]:
    if not isinstance(names, list) or len(names) != n:
        got = len(names) if isinstance(names, list) else _show(names)
        raise ManifestError(f"{field} has {got} entries, needs {n} (one per decoder layer)", file=file)
    out = []
    for i, v in enumerate(names):
        if v not in kinds:
            raise ManifestError(f"{field}[{i}] = {_show(v)}: must be one of {', '.join(kinds)}", file=file)
        out.append(kinds.index(v))
    return out + [extra] * (length - n)


def padded(specs: Mapping, schedules: dict[str, list[int]], length: int) -> dict[str, list[int]]:
    """Each schedule at `length` layers: the draft stages a checkpoint's names add past the config's count take the
    schedule's `extra_kind` (a position schedule: -1), as the layers past a names or count list do."""
    return {name: kinds + [-1 if "position_in" in specs[name] else int(specs[name].get("extra_kind", 0))]
            * (length - len(kinds)) for name, kinds in schedules.items()}


def list_length(env: Mapping, path: str, *, prefix: str, file: str) -> int:
    """The length of the config list at `path` (absent or null: 0), for a part's `lengths` (shape expressions)."""
    value = _lookup(env, path)
    if value is None:
        return 0
    if not isinstance(value, list):
        raise ManifestError(f"{prefix}{path} = {_show(value)}: must be a list", file=file)
    return len(value)


def _lookup(env: Mapping, path: str):
    """env["a"]["b"] for "a.b" (None where a level is absent)."""
    value = env
    for key in path.split("."):
        if not isinstance(value, Mapping):
            return None
        value = value.get(key)
    return value


def _from_members(members: Mapping, kinds: list, length: int, base: int, prefix: str, file: str) -> list[int]:
    """Each layer's kind from lists of the layers of each kind (counted from `base`): every layer in one list at
    most; the layers no list names go to the one kind whose list is absent, else they are an error."""
    out: list[int | None] = [None] * length
    for kind, (path, layers) in members.items():
        if layers is None:
            continue
        if not isinstance(layers, list) or not all(_is_int(v) for v in layers):
            raise ManifestError(f"{prefix}{path} = {_show(layers)}: must be a list of layer numbers", file=file)
        for v in layers:
            if not base <= v < length + base:
                raise ManifestError(f"{prefix}{path} names layer {v}: layers are {base}..{length - 1 + base}", file=file)
            if out[v - base] is not None:
                raise ManifestError(f"{prefix}{path}: layer {v} is listed twice or in two kinds' lists", file=file)
            out[v - base] = kinds.index(kind)
    # a kind with no list, or whose list the config does not give, takes the rest
    absent = [i for i, kind in enumerate(kinds) if kind not in members or members[kind][1] is None]
    if None in out:
        if len(absent) != 1:
            paths = " / ".join(prefix + path for path, _ in members.values())
            raise ManifestError(f"{paths}: layer {out.index(None) + base} is in no list", file=file)
        out = [absent[0] if k is None else k for k in out]
    return out
