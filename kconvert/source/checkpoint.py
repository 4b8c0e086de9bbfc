"""A source checkpoint: config.json + (sharded) safetensors, opened lazily.

`Checkpoint.open(src)` reads config.json, the index and every file's header (never tensor data),
folds quantization companions into logical weights (`logical.fold`) and binds the family
manifest. `validate()` checks every tensor against the manifest (known, right shape, none missing).
`read(name)` reads one logical weight, or a row range of it, dequantized on request.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from functools import partial
from itertools import repeat
from operator import attrgetter
from pathlib import Path

from kconvert.source import hub
from kconvert.errors import CheckpointError, KConvertError, ManifestError
from kconvert.family.manifest import ModelMap, TensorInfo, bind
from kconvert.io.dtypes import ITEMSIZE
from kconvert.io.gc_pause import paused_gc
from kconvert.io.paths import contained
from kconvert.io.safetensors_read import SafetensorsHeader, TensorEntry, read_header
from kconvert.io import typed_json
from kconvert.io.side_files import (MAX_CONFIG, MAX_DEPTH, MAX_INDEX, mapped_bytes, openings_over, parse_json,
                                    read_json)
from kconvert.source.formats import read_logical
from kconvert.source.logical import LogicalTensor, fold
from kconvert.source.stored_parts import check_table
from kconvert.source.tensor_groups import Grouped, check_tensor, group_tensors, stored_positions
from kconvert.io.dtypes import FP8_BLOCK

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
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
        self.logical: dict[str, LogicalTensor] = fold(self.stored)
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
        index_map = _index_map(root)
        names = _shard_files(root, index_map)
        files = {n: read_header(root / n) for n in names}
        stored = _merged(root, files, index_map)
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
        grouped = group_tensors(self.model, self.logical)
        bad = []
        for b in grouped.buckets:
            try:
                check_tensor(b.sample, b.info, b.rule.scale_block or block, group)
            except KConvertError:
                bad.append(b)
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


def _merged(root: Path, files: dict[str, SafetensorsHeader], index_map: dict[str, str] | None) -> dict[str, TensorEntry]:
    """Every file's tensors in one map, each stored once and where the index says. At 200k tensors the checks
    run as whole-list operations, a file at a time; only a checkpoint that fails them is walked tensor by
    tensor, to name one."""
    stored: dict[str, TensorEntry] = {}
    for header in files.values():
        stored.update(header.tensors)
    if len(stored) == sum(len(h.tensors) for h in files.values()) and (index_map is None or (
            len(index_map) == len(stored) and all(list(map(index_map.get, h.tensors)).count(fname) == len(h.tensors)
                                                  for fname, h in files.items()))):
        return stored  # no tensor twice, each where the index says, and the index names no other
    stored = {}
    for fname, header in files.items():
        for tname, entry in header.tensors.items():
            if tname in stored:
                raise CheckpointError(f"tensor stored twice (also in {stored[tname].file.name})", file=str(entry.file),
                                      tensor=tname)
            if index_map is not None and index_map.get(tname) != fname:
                raise CheckpointError(f"tensor is in {fname} but the index says {index_map.get(tname)}",
                                      file=str(root / INDEX), tensor=tname)
            stored[tname] = entry
    for tname, fname in index_map.items():
        if tname not in stored:
            raise CheckpointError(f"the index places this tensor in {fname}, which does not hold it",
                                  file=str(root / fname), tensor=tname)
    raise AssertionError("unreachable: the whole-list checks failed, so one tensor fails the walk")


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


def _index_map(root: Path) -> dict[str, str] | None:
    path = root / INDEX
    if not path.exists():
        return None
    raw, files = mapped_bytes(path, limit=MAX_INDEX), tuple(n for n in os.listdir(root) if n.endswith(".safetensors"))
    weight_map = None if openings_over(raw, MAX_DEPTH) else typed_json.weight_map(raw, files)  # 200k names, in C
    if weight_map is None:  # anything unusual: json.loads, which names what is wrong
        index = parse_json(bytes(raw), file=str(path))
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError("index has no weight_map object", file=str(path))
    try:  # 200k tensors name a few dozen files: each is checked once
        for fname in set(weight_map.values()):
            contained(root, fname, named_in=path)  # the one path rule (kconvert/io/paths.py)
        return weight_map
    except (TypeError, CheckpointError):  # an unhashable name or a bad one: the walk names its first tensor
        pass
    checked: set = set()
    for tname, fname in weight_map.items():
        if not isinstance(fname, str) or fname not in checked:
            contained(root, fname, named_in=path, tensor=tname)
            checked.add(fname)
    return weight_map


def _shard_files(root: Path, index: dict[str, str] | None) -> list[str]:
    if index is not None:
        names = sorted(set(index.values()))
        for n in names:
            if not (root / n).is_file():
                who = next(t for t, f in index.items() if f == n)
                raise CheckpointError(f"the index names {n}, which does not exist", file=str(root / n), tensor=who)
        return names
    if (root / SINGLE).is_file():
        return [SINGLE]
    raise CheckpointError(f"no {INDEX} and no {SINGLE}: no safetensors weights here", file=str(root))


__all__ = ["Checkpoint", "read_config", "ITEMSIZE"]
