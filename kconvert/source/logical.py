"""Logical tensors: a checkpoint's stored tensors folded into the weights the model sees (formats.py reads each
form). Folding runs in bulk where a checkpoint (70k-200k tensors) is uniform: INT4 triples, MXFP4 pairs (Kimi K3's
experts), block-FP8 `weight_scale_inv` pairs and plain weights are matched and wrapped by C-level map/zip/set
operations. Anything else (a missing companion, mixed companion kinds, V4's `.scale` sidecars, FP8 or INT8 weights
with a compressed-tensors scale, NVFP4: modelopt_parts.py) takes the per-name path, which names what is wrong. Both give
the same tensors in the same order."""

from __future__ import annotations

import math
from functools import partial
from itertools import compress, filterfalse, repeat
from operator import add, attrgetter, itemgetter
from typing import NamedTuple

from kconvert.errors import CheckpointError
from kconvert.io.safetensors_read import TensorEntry
from kconvert.io.dtypes import FP4_GROUP
from kconvert.source.modelopt_parts import compressed_tensors_nvfp4, modelopt_nvfp4, scaled_format

FP8_TAGS = ("F8_E4M3", "F8_E5M2")
_PACKED_TAGS = {"int4_packed": "I4", "fp4_packed": "FP4", "nvfp4_packed": "NVFP4"}  # two codes a byte / eight a word
_BY_SUFFIX = (".weight_packed", ".scale", ".weight_scale_inv")  # a companion that names its weight
_SCALE_ONLY = (".weight_scale", ".input_scale", ".weight_scale_2")  # folded with the weight found from the other side
_DTYPE, _SHAPE = attrgetter("dtype"), attrgetter("shape")
_FORMAT, _STORED = attrgetter("format"), attrgetter("stored")
_NAME, _FILE, _BEGIN, _END, _COMPRESSED = (attrgetter(f) for f in ("name", "file", "begin", "end", "compressed"))
_new_entry = partial(tuple.__new__, TensorEntry)  # a TensorEntry from its fields, without a Python-level call


class LogicalTensor(NamedTuple):
    """One model weight as the model sees it, whatever its stored form (a named tuple: folding builds 70k+)."""

    name: str
    shape: tuple[int, ...]
    format: str  # plain | block_fp8 | int4_packed | fp4_packed | nvfp4_packed | scaled
    stored: dict[str, TensorEntry] | TensorEntry  # role -> stored entry; a plain weight's one entry itself

    @property
    def parts(self) -> dict[str, TensorEntry]:
        """Role -> stored entry (a plain weight's is made on request: a release's 70k would each hold a dict)."""
        return {"weight": self.stored} if self.format == "plain" else self.stored

    @property
    def roles(self):
        """(role, stored entry) pairs, in fold's order: a plain weight's one entry is its weight."""
        return (("weight", self.stored),) if self.format == "plain" else self.stored.items()

    @property
    def main(self) -> TensorEntry:
        if self.format == "plain":
            return self.stored
        return self.stored["packed"] if self.format == "int4_packed" else self.stored["weight"]

    @property
    def stored_dtype(self) -> str:
        return _PACKED_TAGS.get(self.format) or self.main.dtype

    @property
    def stored_bytes(self) -> int:
        return sum(p.end - p.begin for _, p in self.roles)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def stored_form(t: LogicalTensor) -> tuple:
    """How a logical tensor is stored: its format and shape, each part's role, dtype and shape. Tensors of one form
    are checked alike (tensor_groups.py, through stored_alike below) and read as one stack (stacked.py)."""
    return t.format, t.shape, tuple([(role, p.dtype, p.shape) for role, p in t.roles])


def stored_alike(ts: list[LogicalTensor]) -> bool:
    """Whether every tensor's stored_form is the first one's: the same fields (format, shape, each part's role, dtype
    and shape, in order), compared in a few whole-list passes rather than a form built per tensor (validation asks
    it of every (rule, layer) group: 70k tensors at a release's size; `bench/open_phases.py` times it, and
    `bench/instructions.py --phases` counts it). Counted with list.count, which takes an object as equal to itself
    before comparing: the header reader shares one tuple per distinct shape and one str per dtype tag, so most
    members cost an identity test, not a hash. tests/source/test_tensor_groups.py checks the buckets against a per-tensor
    walk."""
    t0, n = ts[0], len(ts)
    if n == 1:
        return True
    if list(map(_FORMAT, ts)).count(t0.format) != n or list(map(_SHAPE, ts)).count(t0.shape) != n:
        return False
    parts = list(map(_STORED, ts))
    if t0.format == "plain":  # a plain tensor stores one entry, of the tensor's own shape
        return list(map(_DTYPE, parts)).count(t0.stored.dtype) == n
    if list(map(len, parts)).count(len(t0.parts)) != n:
        return False
    try:  # as many roles as the first and each of its roles: the same roles, in the same order (fold builds one
        # format's parts in one order, and the formats are equal here)
        for role, p0 in t0.parts.items():
            entries = list(map(itemgetter(role), parts))
            if list(map(_DTYPE, entries)).count(p0.dtype) != n or list(map(_SHAPE, entries)).count(p0.shape) != n:
                return False
    except KeyError:
        return False
    return True


STACKED_FORMATS = ("plain", "int4_packed", "fp4_packed")  # what source/stacked.py reads many of as one stack


def stack_form(t: LogicalTensor) -> tuple | None:
    """What weights must share to be read as one stack (source/stacked.py): their stored form; None: this one is
    read on its own (another format, a compressed part, no values)."""
    if t.format not in STACKED_FORMATS or not t.numel:
        return None
    for _, p in t.roles:
        if p.compressed is not None:
            return None
    return stored_form(t)


_new = partial(tuple.__new__, LogicalTensor)  # from (name, shape, format, stored), without a Python-level call


def _bulk(rows):
    """LogicalTensors from (name, shape, format, stored) rows, lazily, each built by tuple.__new__ from C."""
    return map(tuple.__new__, repeat(LogicalTensor), rows)


def fold(stored: dict[str, TensorEntry]) -> dict[str, LogicalTensor]:
    """Group stored tensors into logical ones. Raises CheckpointError on orphans or missing companions.
    Order: the weights that companions name, in the companions' stored order, then the rest in stored order."""
    companions = any(map(str.endswith, stored, repeat(_BY_SUFFIX + _SCALE_ONLY)))  # none in a BF16 release: one pass
    named = list(compress(stored, map(str.endswith, stored, repeat(_BY_SUFFIX)))) if companions else []
    out: dict[str, LogicalTensor] = {}
    used: set[str] = set()
    if named and not _named_bulk(stored, named, out, used):  # it changes nothing when it declines
        _named_one_by_one(stored, named, out, used)
    rest = list(filterfalse(used.__contains__, stored)) if used else list(stored)
    entries = list(map(stored.__getitem__, rest)) if used else list(stored.values())
    scale_only = companions and any(map(str.endswith, rest, repeat(_SCALE_ONLY)))
    if not scale_only and set(map(_DTYPE, entries)).isdisjoint(FP8_TAGS + ("I8",)):
        out.update(zip(rest, _bulk(zip(rest, map(_SHAPE, entries), repeat("plain"), entries))))
    else:
        _rest_one_by_one(stored, rest, out)
    return out


def _named_bulk(stored: dict[str, TensorEntry], named: list[str], out: dict, used: set) -> bool:
    """All INT4 triples, all MXFP4 pairs or all block-FP8 pairs, each complete and well-formed: fold them at once
    (True). False leaves the per-name path to fold them, or to name the one that is wrong."""
    if all(map(str.endswith, named, repeat(".weight_packed"))):
        bases = list(map(str.removesuffix, named, repeat("_packed")))
        scale_keys, shape_keys = list(map(add, bases, repeat("_scale"))), list(map(add, bases, repeat("_shape")))
        packed = list(map(stored.__getitem__, named))
        scales = list(map(stored.get, scale_keys))
        # no `weight_shape` stored at all (MXFP4): none to look up, 250k times
        shapes = list(map(stored.get, shape_keys)) if any(map(str.endswith, stored, repeat(".weight_shape"))) \
            else [None] * len(named)
        if None in scales or set(map(len, map(_SHAPE, packed))) != {2}:
            return False
        if set(map(_DTYPE, packed)) == {"U8"} and shapes.count(None) == len(shapes):  # MXFP4: no weight_shape
            if set(map(_DTYPE, scales)) != {"U8"}:
                return False
            pairs = list(zip(map(_SHAPE, packed), map(_SHAPE, scales)))  # a few distinct (shared tuples): checked once
            if any(_mxfp4_shapes_misfit(*pair) for pair in set(pairs)):
                return False
            logical = _widened(list(map(itemgetter(0), pairs)), 2)
            # the scales' entries read as the e8m0 they are, built from their columns (not a _replace each)
            e8m0 = map(_new_entry, zip(map(_NAME, scales), map(_FILE, scales), repeat("F8_E8M0"),
                                       map(_SHAPE, scales), map(_BEGIN, scales), map(_END, scales),
                                       map(_COMPRESSED, scales)))
            parts = [{"weight": p, "scale": s} for p, s in zip(packed, e8m0)]
            out.update(zip(bases, _bulk(zip(bases, logical, repeat("fp4_packed"), parts))))
            used.update(named, scale_keys)
            return True
        if None in shapes or set(map(_DTYPE, packed)) != {"I32"}:
            return False
        logical = _widened(list(map(_SHAPE, packed)), 8)
        parts = [{"packed": p, "scale": s, "shape": h} for p, s, h in zip(packed, scales, shapes)]
        out.update(zip(bases, _bulk(zip(bases, logical, repeat("int4_packed"), parts))))
        used.update(named, scale_keys, shape_keys)  # keys, not on-disk names (family aliases)
        return True
    if all(map(str.endswith, named, repeat(".weight_scale_inv"))):
        bases = list(map(str.removesuffix, named, repeat("_scale_inv")))
        weights = list(map(stored.get, bases))
        if None in weights:
            return False
        parts = [{"weight": w, "scale": stored[n]} for w, n in zip(weights, named)]
        out.update(zip(bases, _bulk(zip(bases, map(_SHAPE, weights), repeat("block_fp8"), parts))))
        used.update(named, bases)
        return True
    return False


def _widened(shapes: list[tuple], codes: int) -> list[tuple]:
    """Each packed [R, C / codes] shape as its logical [R, C]: one tuple per distinct shape, shared as the header
    reader shares its shapes (a release's 250k experts have a handful)."""
    logical = {s: (s[0], s[1] * codes) for s in set(shapes)}
    return list(map(logical.__getitem__, shapes))


def _named_one_by_one(stored: dict[str, TensorEntry], named: list[str], out: dict, used: set) -> None:
    def need(base: str, suffix: str, for_name: str) -> TensorEntry:
        e = stored.get(base + suffix)
        if e is None:
            raise CheckpointError(f"{for_name} needs a companion {base + suffix} that is absent",
                                  file=str(stored[for_name].file), tensor=for_name)
        return e

    for name in named:
        e = stored[name]
        if name.endswith(".weight_packed") and (b := name[: -len("_packed")]) + "_global_scale" in stored:  # CT NVFP4
            out[b] = _new(compressed_tensors_nvfp4(b, stored, used))
        elif name.endswith(".weight_packed") and e.dtype == "U8" and name[: -len("_packed")] + "_shape" not in stored:
            base = name[: -len("_packed")]
            out[base] = _mxfp4(base, e, need(base, "_scale", name))
            used.update((name, base + "_scale"))
        elif name.endswith(".weight_packed"):
            base = name[: -len("_packed")]
            scale, shape_t = need(base, "_scale", name), need(base, "_shape", name)
            if e.dtype != "I32" or len(e.shape) != 2:
                raise CheckpointError(f"weight_packed must be int32 2-D, is {e.dtype}{list(e.shape)}",
                                      file=str(e.file), tensor=name)
            out[base] = _new((base, (e.shape[0], e.shape[1] * 8), "int4_packed",
                              {"packed": e, "scale": scale, "shape": shape_t}))
            used.update((name, base + "_scale", base + "_shape"))
        elif name.endswith(".scale"):  # DeepSeek-V4's sidecar: `X.scale` beside `X.weight`
            base = name[: -len(".scale")] + ".weight"
            if base not in stored:
                raise CheckpointError("quantization scale without its weight", file=str(e.file), tensor=name)
            out[base] = _sidecar(stored[base], e)
            used.update((name, base))
        else:  # .weight_scale_inv
            base = name[: -len("_scale_inv")]
            out[base] = _new((base, need(base, "", name).shape, "block_fp8", {"weight": stored[base], "scale": e}))
            used.update((name, base))


def _rest_one_by_one(stored: dict[str, TensorEntry], rest: list[str], out: dict) -> None:
    for name in rest:
        e = stored[name]
        if name.endswith(_SCALE_ONLY):
            if name.rsplit(".", 1)[0] + ".weight" not in stored:
                raise CheckpointError("quantization scale without its weight", file=str(e.file), tensor=name)
            continue  # folded below with its weight
        if e.dtype == "U8" and name + "_scale_2" in stored:  # ModelOpt's NVFP4 (its scales: skipped above)
            out[name] = _new(modelopt_nvfp4(name, stored))
        elif e.dtype in FP8_TAGS or (e.dtype == "I8" and name + "_scale" in stored):
            scale = stored.get(name + "_scale")
            if scale is None:
                raise CheckpointError(f"{e.dtype} weight has no weight_scale_inv / weight_scale",
                                      file=str(e.file), tensor=name)
            parts = {"weight": e, "scale": scale}
            inp = stored.get(name.rsplit(".", 1)[0] + ".input_scale")
            if inp is not None:
                parts["input_scale"] = inp
            out[name] = _new((name, e.shape, scaled_format(scale), parts))
        else:
            out[name] = _new((name, e.shape, "plain", e))


def _sidecar(w: TensorEntry, scale: TensorEntry) -> LogicalTensor:
    """A V4 weight and its `.scale`: FP8 blocks (e8m0 or float32 scales) or FP4 e2m1 pairs (e8m0 per 32)."""
    def bad(why: str) -> CheckpointError:
        return CheckpointError(why, file=str(scale.file), tensor=scale.name)

    if w.dtype == "F8_E4M3":
        if scale.dtype not in ("F8_E8M0", "F32") or len(scale.shape) != 2:
            raise bad(f"an FP8 weight's scale must be F8_E8M0 or F32 2-D, is {scale.dtype}{list(scale.shape)}")
        return _new((w.name, w.shape, "block_fp8", {"weight": w, "scale": scale}))
    if w.dtype in ("I8", "U8") and len(w.shape) == 2:
        rows, cols = w.shape[0], w.shape[1] * 2
        if scale.dtype != "F8_E8M0" or tuple(scale.shape) != (rows, -(-cols // FP4_GROUP)) or cols % FP4_GROUP:
            raise bad(f"FP4 weight {list(w.shape)} (two codes a byte) needs an F8_E8M0 scale [{rows}, {cols // FP4_GROUP}] "
                      f"per {FP4_GROUP} inputs, is {scale.dtype}{list(scale.shape)}")
        return _new((w.name, (rows, cols), "fp4_packed", {"weight": w, "scale": scale}))
    raise bad(f"a .scale sidecar belongs to an F8_E4M3 or packed-FP4 int8 weight, not {w.dtype}{list(w.shape)}")


def _mxfp4_misfit(packed: TensorEntry, scale: TensorEntry) -> str | None:
    """What is wrong with a compressed-tensors MXFP4 pair's shapes (None: packed [R, C/2], scale [R, C/32])."""
    if _mxfp4_shapes_misfit(packed.shape, scale.shape):
        rows, cols = packed.shape[0], packed.shape[1] * 2
        return (f"MXFP4 weight_packed {list(packed.shape)} (two e2m1 codes a byte) needs a U8 e8m0 weight_scale "
                f"[{rows}, {cols // FP4_GROUP}] (one per {FP4_GROUP} inputs), is {scale.dtype}{list(scale.shape)}")
    return None


def _mxfp4_shapes_misfit(packed: tuple, scale: tuple) -> bool:
    rows, cols = packed[0], packed[1] * 2
    return len(packed) != 2 or bool(cols % FP4_GROUP) or tuple(scale) != (rows, cols // FP4_GROUP)


def _mxfp4(base: str, packed: TensorEntry, scale: TensorEntry) -> LogicalTensor:
    """compressed-tensors `mxfp4-pack-quantized`: the same arithmetic as DeepSeek-V4's FP4 experts (e2m1 code pairs,
    low nibble the even element; e8m0 per 32 inputs), so it folds to the same fp4_packed weight, its U8 scale
    bytes read as the e8m0 they are (byte 255, NaN, refused by every reader)."""
    misfit = _mxfp4_misfit(packed, scale) if scale.dtype == "U8" and len(packed.shape) == 2 else \
        f"MXFP4 weight_packed must be U8 2-D with a U8 weight_scale, is {packed.dtype}{list(packed.shape)} + " \
        f"{scale.dtype}{list(scale.shape)}"
    if misfit:
        raise CheckpointError(misfit, file=str(scale.file), tensor=scale.name)
    return _new((base, (packed.shape[0], packed.shape[1] * 2), "fp4_packed",
                 {"weight": packed, "scale": scale._replace(dtype="F8_E8M0")}))
