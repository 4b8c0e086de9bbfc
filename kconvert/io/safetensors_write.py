"""Write one safetensors file tensor by tensor, crash-safely.

The header is computed up front from the planned (name, dtype, shape) list, so tensors can be
produced and written one at a time (memory: one tensor). Bytes go to a hidden temporary name,
are fsynced, then renamed into place (and the directory fsynced): a file under its final name is
always complete. CRC-32 of the whole file and of each tensor's bytes are computed as they pass.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kconvert.io.atomic import fsync_dir, write_error
from kconvert.io.dtypes import ITEMSIZE, TAGS


@dataclass
class WrittenFile:
    path: Path
    bytes: int
    crc32: str
    tensor_crc32: dict[str, str] = field(default_factory=dict)


def tensor_bytes(t: torch.Tensor):
    """A zero-copy byte view of a CPU tensor (numpy has no bf16/fp8, so view as uint8 first)."""
    t = t.detach().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""


class SafetensorsWriter:
    def __init__(self, path: Path, specs: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self.specs = list(specs)
        header: dict = {"__metadata__": metadata} if metadata else {}
        offset = 0
        for name, tag, shape in self.specs:
            n = math.prod(shape) * ITEMSIZE[tag]
            header[name] = {"dtype": tag, "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data region 8-byte aligned, as safetensors writes it
        self._head = len(raw).to_bytes(8, "little") + raw
        self.total = len(self._head) + offset
        self._next = 0
        self._crc = 0
        self._tensor_crc: dict[str, str] = {}
        self.tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.tmp, "wb")
        self._write(self._head)

    def _write(self, data) -> None:
        try:
            self._f.write(data)
        except OSError as e:
            self.abort()
            raise write_error(e, self.path) from None
        self._crc = zlib.crc32(data, self._crc)

    def write(self, name: str, t: torch.Tensor) -> None:
        want_name, tag, shape = self.specs[self._next]
        if name != want_name or TAGS.get(t.dtype) != tag or tuple(t.shape) != tuple(shape):
            self.abort()
            raise RuntimeError(f"writer expected {want_name} {tag}{list(shape)}, got {name} {t.dtype}{list(t.shape)}")
        data = tensor_bytes(t)
        self._write(data)
        self._tensor_crc[name] = f"{zlib.crc32(data):08x}"
        self._next += 1

    def commit(self) -> WrittenFile:
        if self._next != len(self.specs):
            self.abort()
            raise RuntimeError(f"{self.path}: {len(self.specs) - self._next} planned tensors never written")
        try:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            os.replace(self.tmp, self.path)
            fsync_dir(self.path.parent)
        except OSError as e:
            self.abort()
            raise write_error(e, self.path) from None
        return WrittenFile(self.path, self.total, f"{self._crc:08x}", self._tensor_crc)

    def abort(self) -> None:
        try:
            self._f.close()
        finally:
            self.tmp.unlink(missing_ok=True)
