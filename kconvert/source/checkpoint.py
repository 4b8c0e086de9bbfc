"""A source checkpoint: config.json + (sharded) safetensors, opened lazily.

`Checkpoint.open(src)` reads config.json, the index and every file's header (never tensor data; source/
stored_files.py) and binds the family manifest. `validate()` checks every tensor against the manifest (known, right
shape, none missing) a (rule, layer) group at a time, from the stored entries' columns where every group is stored
in one form (source/stored_groups.py), so inspect and plan never fold a release's 250k experts. `logical` gives the
logical weights (quantization companions folded in): made name by name from those columns on request
(source/logical_by_name.py: shard never folds a release), else folded whole on first use (`logical.fold`);
`read(name)` reads one logical weight, or a row range of it, dequantized on request.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping
from functools import partial
from itertools import repeat
from operator import attrgetter
from pathlib import Path

from kconvert.source import hub
from kconvert.errors import CheckpointError, KConvertError, ManifestError
from kconvert.family.manifest import ModelMap, TensorInfo, bind
from kconvert.io.dtypes import ITEMSIZE
from kconvert.io.gc_pause import paused_gc
from kconvert.io.safetensors_read import SafetensorsHeader, TensorEntry
from kconvert.io.side_files import MAX_CONFIG, read_json
from kconvert.source.formats import read_logical
from kconvert.source.logical import LogicalTensor, fold
from kconvert.source.logical_by_name import LogicalByName
from kconvert.source.stored_groups import group_stored
from kconvert.source.stored_parts import check_table
from kconvert.source.quant_claims import check_claims
from kconvert.source.tensor_groups import Grouped, check_tensor, group_tensors, stored_positions
from kconvert.source.stored_files import INDEX, SINGLE, index_map_of, merged, read_headers, shard_files
from kconvert.io.dtypes import FP8_BLOCK
_FILE, _SHAPE = attrgetter("file"), attrgetter("shape")
_info_of = partial(tuple.__new__, TensorInfo)  # 70k TensorInfo from (name, rule, layer, expert) at C level


class Checkpoint:
    def __init__(self, root: Path, config: dict, files: dict[str, SafetensorsHeader | None],
                 stored: dict[str, TensorEntry], *, source: str, remote: bool = False):
        self.root, self.config, self.files, self.stored = root, config, files, stored
        self.source, self.remote = source, remote
        # the names too: a family may count draft stages its config undercounts from them (DeepSeek-V4-0731)
        self.model: ModelMap = bind(config, config_file=str(root / "config.json"), names=stored)
        if self.model.aliases:  # the family's other spellings (transformers' save-side names) read as published
            self.stored = _canonical(self.model, stored)
        # a quantization_config contradicting the stored bytes (it is copied into what a conversion writes)
        check_claims(config, self.model.family.get("text_config", "."), self.stored, file=str(root / "config.json"))
        self._logical: Mapping[str, LogicalTensor] | None = None  # on first use: inspect and plan never need it
        self._columnar = False  # validated from the stored columns (source/stored_groups.py)
        self._info: dict[str, TensorInfo] = {}
        self._grouped: Grouped | None = None  # by validate()
        self._infos_filled = False  # the buckets' tensors' infos in _info (built at C speed on first need)

    # ------------------------------------------------------------------ opening
    @classmethod
    def open(cls, src: str | os.PathLike, *, revision: str | None = None, headers_only: bool = False) -> "Checkpoint":
        with paused_gc():  # 100k+ header entries and logical tensors: see io/gc_pause.py
            return cls._open(src, revision, headers_only)

    @classmethod
    def _open(cls, src: str | os.PathLike, revision: str | None, headers_only: bool) -> "Checkpoint":
        text = str(src)
        if hub.looks_like_repo_id(text):
            if headers_only and not hub._offline():
                root = hub.snapshot(text, revision=revision, weights=False)
                return cls._from_remote(root, text, revision)
            root = hub.snapshot(text, revision=revision, weights=True)
        else:
            root = Path(text)
            if not root.is_dir():
                raise CheckpointError("not a directory (nor a Hub repo id like org/name)", file=text)
        config = read_config(root)
        index_map = index_map_of(root)
        names = shard_files(root, index_map)
        files, agreed = read_headers(root, names, index_map)
        del index_map  # what is left of it: the headers hold every name again
        stored = merged(root, files, agreed)
        return cls(root, config, files, stored, source=text)

    @classmethod
    def _from_remote(cls, root: Path, repo_id: str, revision: str | None) -> "Checkpoint":
        config = read_config(root)
        stored: dict[str, TensorEntry] = {}
        for fname, tensors in hub.remote_headers(repo_id, revision=revision).items():
            for tname, spec in tensors.items():
                lo, hi = spec["data_offsets"]
                shape = tuple(spec["shape"])
                if spec["dtype"] not in ITEMSIZE or hi - lo != math.prod(shape) * ITEMSIZE[spec["dtype"]]:
                    raise CheckpointError(f"remote header entry {spec['dtype']}{list(shape)} [{lo}, {hi}] is malformed",
                                          file=f"{repo_id}/{fname}", tensor=tname)
                stored[tname] = TensorEntry(tname, root / fname, spec["dtype"], shape, lo, hi)
        return cls(root, config, {f: None for f in {e.file.name for e in stored.values()}}, stored,
                   source=repo_id, remote=True)

    # ------------------------------------------------------------------ queries
    @property
    def logical(self) -> Mapping[str, LogicalTensor]:
        """Every logical weight by name, in fold's order (logical.fold: companions folded into their weights). Once
        validated from the stored columns, a name's is made on request (source/logical_by_name.py): a conversion
        that reads the experts as stacks never folds them."""
        if self._logical is None:
            if self._columnar:  # by name from the buckets' columns; folded only if walked whole
                self._logical = LogicalByName(self._grouped.buckets, partial(_folded, self.stored))  # (no cycle)
            else:
                self._logical = _folded(self.stored)
        return self._logical

    @property
    def tensor_count(self) -> int:
        """Logical tensors held: counted from the validated buckets (every one is in a bucket), not by folding."""
        return sum(map(len, map(attrgetter("names"), self.grouped.buckets)))

    @property
    def family(self) -> str:
        return self.model.name

    @property
    def text_config(self) -> dict:
        return self.model.text_config

    def info(self, name: str) -> TensorInfo:
        """Manifest classification of a logical tensor (ManifestError if unknown)."""
        info = self._info.get(name)
        if info is None and self._grouped is not None and not self._infos_filled:  # once: every bucketed tensor's
            self._infos_filled = True
            for b in self._grouped.buckets:
                self._info.update(zip(b.names, map(_info_of, zip(b.names, repeat(b.rule), repeat(b.layer), b.experts))))
            info = self._info.get(name)
        if info is None:
            info = self.model.classify(name)
            if info is None:
                t = self.logical[name]
                raise ManifestError(f"tensor not known to the {self.family} manifest", file=str(t.main.file), tensor=name)
            self._info[name] = info
        return info

    @property
    def grouped(self) -> Grouped:
        """The validated tensors by manifest (rule, layer), stored alike (source/tensor_groups.py)."""
        self.validate()
        return self._grouped

    def validate(self) -> None:
        """Every tensor known with the shape config.json implies; every required tensor present. Checked a
        bucket at a time; when anything fails, the error is the one a walk in stored order meets first."""
        if self._grouped is None:
            with paused_gc():
                self._grouped = self._validate()

    def _validate(self) -> Grouped:
        block, group = self.quant_block(), self.int4_group()
        grouped = group_stored(self.model, self.stored)  # columnar, when every group is stored in one fold form
        if grouped is not None and grouped.missing is None and all(
                _passes(b.sample, b.info, b.rule.scale_block or block, group) for b in grouped.buckets):
            self._columnar = True
            return grouped
        grouped = group_tensors(self.model, self.logical)  # anything else, and every failure: named as always
        bad = [b for b in grouped.buckets if not _passes(b.sample, b.info, b.rule.scale_block or block, group)]
        if grouped.rest or bad:  # report what a walk in stored order meets first; a bucket's members fail alike
            pos = stored_positions(self.logical)
            failed = [b.earliest(pos) for b in bad] + [(list(self.logical).index(n), None) for n in grouped.rest[:1]]
            _, info = min(failed, key=lambda f: f[0])
            first = grouped.rest[0] if info is None else info.name
            info = info or self.info(first)  # self.info: an unknown name raises here
            check_tensor(self.logical[first], info, info.rule.scale_block or block, group)
            raise AssertionError(f"unreachable: {first} failed its check once")
        if grouped.missing is not None:
            where = INDEX if (self.root / INDEX).exists() else SINGLE
            raise ManifestError(f"required by the {self.family} manifest but absent from the checkpoint",
                                file=str(self.root / where), tensor=grouped.missing)
        return grouped

    @property
    def quantization_config(self) -> dict:
        """The source's quantization_config (top level, or the text config's for multimodal families)."""
        return self.config.get("quantization_config") or self.text_config.get("quantization_config") or {}

    def quant_block(self) -> tuple[int, int]:
        b = self.quantization_config.get("weight_block_size") or [FP8_BLOCK, FP8_BLOCK]
        return int(b[0]), int(b[1])

    def block_of(self, name: str) -> tuple[int, int]:
        """The FP8 scale grid of logical weight `name`: its manifest rule's (`scale_block`), else the config's."""
        return self.info(name).rule.scale_block or self.quant_block()

    def int4_group(self) -> int:
        for group in (self.quantization_config.get("config_groups") or {}).values():
            g = (group.get("weights") or {}).get("group_size")
            if g:
                return int(g)
        return 32

    def read(self, name: str, *, rows: tuple[int, int] | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A logical weight (or rows [a, b) of it), dequantized from block-FP8 / INT4 / scaled forms."""
        if self.remote:
            raise CheckpointError("only headers were fetched from the Hub; download the repo to read weights",
                                  file=self.source, tensor=name)
        t = self.logical.get(name)
        if t is None:
            raise CheckpointError("no such tensor in the checkpoint", file=str(self.root), tensor=name)
        x = read_logical(t, rows=rows, dtype=dtype, block=self.block_of(name), group=self.int4_group())
        bound = self.info(name).rule.values_below
        if bound is not None:
            check_table(t, x, int(self.info(name).rule.part._eval(bound)), bound)
        return x

    def fingerprint(self) -> str:
        """Identity of the source from what defines it cheaply: config + every header (names, dtypes,
        shapes, offsets) + file sizes. Changes when any tensor is added, moved, resized or retyped."""
        h = hashlib.sha256(json.dumps(self.config, sort_keys=True).encode())
        entries = list(map(self.stored.__getitem__, sorted(self.stored)))
        files = {f: f.name for f in set(map(_FILE, entries))}  # a few dozen: Path.name and a shape's repr once each
        shapes = {s: str(s) for s in set(map(_SHAPE, entries))}
        for i in range(0, len(entries), 4096):  # a few thousand lines an update: the same digest, a few MB at most
            h.update("".join([f"{name}|{files[f]}|{dtype}|{shapes[shape]}|{b}|{e}\n"
                              for name, f, dtype, shape, b, e, _ in entries[i:i + 4096]]).encode())
        for fname, header in sorted(self.files.items()):
            h.update(f"{fname}:{header.size if header else -1}\n".encode())
        return h.hexdigest()[:32]


def _folded(stored: dict[str, TensorEntry]) -> dict[str, LogicalTensor]:
    with paused_gc():
        return fold(stored)


def _passes(t: LogicalTensor, info: TensorInfo, block: tuple[int, int], group: int) -> bool:
    try:
        check_tensor(t, info, block, group)
        return True
    except KConvertError:
        return False


def _canonical(model: ModelMap, stored: dict[str, TensorEntry]) -> dict[str, TensorEntry]:
    """Stored tensors under the names the manifest knows (entries keep their on-disk names for messages)."""
    if not model.aliased(stored):
        return stored  # the usual case
    out: dict[str, TensorEntry] = {}
    for name, entry in stored.items():
        key = model.canonical(name)
        if key in out:
            raise CheckpointError(f"stored under two spellings of {key} (also as {out[key].name})",
                                  file=str(entry.file), tensor=name)
        out[key] = entry
    return out


def read_config(root: Path) -> dict:
    path = root / "config.json"
    try:
        config = read_json(path, limit=MAX_CONFIG)
    except FileNotFoundError:
        raise CheckpointError("config.json is missing: not a model checkpoint directory", file=str(path)) from None
    if not isinstance(config, dict):
        raise CheckpointError("config.json is not a JSON object", file=str(path))
    return config


__all__ = ["Checkpoint", "read_config", "ITEMSIZE"]
