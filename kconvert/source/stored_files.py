"""A source checkpoint's files: the index, every file's header, and one map of every stored tensor, checked to agree
(each tensor stored once, where the index places it; every file the index names present and inside the
checkpoint). At 500k tensors the checks run as whole-list operations; a checkpoint that fails them is walked
tensor by tensor, to name one."""

from __future__ import annotations

import os
from pathlib import Path

from kconvert.errors import CheckpointError
from kconvert.io import typed_json
from kconvert.io.paths import contained
from kconvert.io.safetensors_read import SafetensorsHeader, TensorEntry, read_header
from kconvert.io.side_files import MAX_DEPTH, MAX_INDEX, mapped_bytes, openings_over, parse_json

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def index_map_of(root: Path) -> dict[str, str] | None:
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


def shard_files(root: Path, index: dict[str, str] | None) -> list[str]:
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


def read_headers(root: Path, names: list[str], index_map: dict[str, str] | None) -> tuple[dict, bool | None]:
    """Every file's header, and whether each holds exactly what the index places in it (None: no index). A file's
    names are popped from the index as its header agrees (in C, a file at a time): a 500k-tensor index holds 50 MB
    of names the headers repeat, freed as they are read rather than held beside them."""
    files: dict[str, SafetensorsHeader] = {}
    agreed = None if index_map is None else True
    for n in names:
        h = files[n] = read_header(root / n)
        if agreed:
            try:
                agreed = list(map(index_map.pop, h.tensors)).count(n) == len(h.tensors)
            except KeyError:  # a name the index does not hold (any more: stored twice)
                agreed = False
    return files, (agreed and not index_map) if agreed is not None else None


def merged(root: Path, files: dict[str, SafetensorsHeader], agreed: bool | None) -> dict[str, TensorEntry]:
    """Every file's tensors in one map, each stored once and where the index says (`agreed`: read_headers' answer;
    None: there is no index). Only a checkpoint that fails is walked tensor by tensor, against the index read
    again, to name one."""
    stored: dict[str, TensorEntry] = {}
    for header in files.values():
        stored.update(header.tensors)
    if agreed is not False and len(stored) == sum(len(h.tensors) for h in files.values()):
        return stored  # no tensor twice, each where the index says, and the index names no other
    index_map = index_map_of(root)
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
    for tname, fname in (index_map or {}).items():
        if tname not in stored:
            raise CheckpointError(f"the index places this tensor in {fname}, which does not hold it",
                                  file=str(root / fname), tensor=tname)
    raise AssertionError("unreachable: the whole-list checks failed, so one tensor fails the walk")
