"""The calibration's resume state: each decoder layer's input, kept under OUT/.kconvert/calibration/ as the run
reaches it (`input-LLLL.safetensors`), so a killed `shard` / `export --calibrate` restarts from the latest one.

A kept input decides every code computed after it, so it is trusted only as far as a shard is: each file
records a sha256 over the job it belongs to (the run's identity: source fingerprint, options, calibration data
record), its layer, its dtype and shape and its bytes; on resume a file is used only when that digest matches,
the tensor is float32 with the calibration's [sequences, tokens, ...] shape and every value is finite. Anything
else (an edited, zeroed, truncated or swapped input, another job's, NaN, a FIFO, a directory, a symlink, a
stray name) is not read as data: it is removed and the layers are recomputed from an earlier kept input or
from the embeddings, which gives the codes an uninterrupted run gives (the calibration is deterministic).
Files are opened by the one regular-file reader (kconvert/io/regular.py: a FIFO never blocks the resume)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
from pathlib import Path

import torch

from kconvert.errors import KConvertError
from kconvert.io.atomic import write_atomic
from kconvert.io.safetensors_read import read_header, read_tensor
from kconvert.source.formats import all_finite

_NAME = re.compile(r"input-(\d{4})\.safetensors")


def binding_of(identity: dict) -> str:
    """What a kept input is tied to: the run's identity (source, options, calibration data), as a digest."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()


def _digest(binding: str, layer: int, x: torch.Tensor) -> str:
    h = hashlib.sha256(f"{binding}|{layer}|{x.dtype}|{list(x.shape)}|".encode())
    h.update(x.contiguous().view(torch.uint8).reshape(-1).numpy().data)
    return h.hexdigest()


class KeptInputs:
    """The kept layer inputs of one run in `folder`, tied to `binding` (binding_of the run's identity)."""

    def __init__(self, folder: Path, binding: str):
        self.folder, self.binding = Path(folder), binding
        self.folder.mkdir(parents=True, exist_ok=True)
        self.discarded: list[str] = []  # what a resume found damaged and recomputed (file names)

    def path(self, layer: int) -> Path:
        return self.folder / f"input-{layer:04d}.safetensors"

    def keep(self, layer: int, x: torch.Tensor) -> None:
        from safetensors.torch import save

        x = x.contiguous()
        meta = {"layer": str(layer), "digest": _digest(self.binding, layer, x)}
        write_atomic(self.path(layer), save({"x": x}, metadata=meta))

    def layers(self) -> list[int]:
        """The layers with a kept input (by name; their contents are checked by `load`). Any other entry is
        removed: nothing but kept inputs lives here."""
        found = []
        for entry in os.scandir(self.folder):
            m = _NAME.fullmatch(entry.name)
            if m and entry.is_file(follow_symlinks=False):
                found.append(int(m.group(1)))
            elif not entry.name.startswith("."):  # (atomic writes' temporaries are hidden)
                self._discard(entry.name)
        return sorted(found)

    def load(self, layer: int, lead: tuple[int, int]) -> torch.Tensor | None:
        """Layer `layer`'s kept input when it passes every check (`lead`: its [sequences, tokens]), else None
        (and the file is gone)."""
        path = self.path(layer)
        try:
            header = read_header(path)
            entry = header.tensors.get("x")
            ok = (header.compressed is None and set(header.tensors) == {"x"} and entry.dtype == "F32"
                  and len(entry.shape) >= 3 and tuple(entry.shape[:2]) == tuple(lead)
                  and header.metadata.get("layer") == str(layer))
            x = read_tensor(entry).clone() if ok else None  # (a private copy: the next layer overwrites it in place)
        except KConvertError:
            x = None
        if x is None or header.metadata.get("digest") != _digest(self.binding, layer, x) or not all_finite(x):
            self._discard(path.name)
            return None
        return x

    def drop_before(self, layer: int) -> None:
        for L in self.layers():
            if L < layer:
                self.path(L).unlink(missing_ok=True)

    def _discard(self, name: str) -> None:
        self.discarded.append(name)
        path = self.folder / name
        try:
            if stat.S_ISDIR(path.lstat().st_mode):
                shutil.rmtree(path)  # (a directory, not a link to one: rmtree never follows links out)
            else:
                path.unlink()
        except FileNotFoundError:
            pass
