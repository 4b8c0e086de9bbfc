"""Shared by the fault-injection tests (test_fault_injection*.py): sandboxed copies of a fixture,
a conversion that must either succeed or refuse cleanly, and snapshots proving nothing outside OUT
changed."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import torch

from helpers import shard_job
from kconvert.convert.shard.job import shard
from kconvert.errors import KConvertError

SEED = 20261130
CLI_EVERY = 40  # one case in this many also runs through `kconvert` (the first in a subprocess, the rest in-process)
MANIFEST = "kconvert.json"
FLOATS = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def snapshot(root: Path, skip: Path | None = None) -> dict[str, tuple[int, int]]:
    """Every file under `root` (but `skip`) with its size and mtime: any write shows up."""
    out = {}
    for p in sorted(root.rglob("*")):
        if skip is not None and (p == skip or skip in p.parents):
            continue
        st = p.lstat()
        out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns) if p.is_file() else (-1, 0)
    return out


def refused(fn) -> KConvertError | None:
    """None when `fn()` succeeds; the error when it refuses as a user would be told (exit 2, one line).
    Any other exception (an exit-3 internal error for a user) propagates and fails the test."""
    try:
        fn()
        return None
    except KConvertError as e:
        assert e.exit_code == 2, e
        assert "\n" not in e.one_line()
        return e


def convert(src: Path, out: Path, **kw) -> KConvertError | None:
    job = shard_job(src, out, tp=kw.pop("tp", 2), quant=kw.pop("quant", "fp8"), **kw)
    return refused(lambda: shard(job))


def library_reads(f: Path) -> dict[str, torch.Tensor] | None:
    """Every tensor of `f` as the safetensors library reads it, or None when it refuses the file."""
    from safetensors import safe_open

    try:
        with safe_open(f, "pt") as g:
            return {k: g.get_tensor(k) for k in g.keys()}
    except Exception:  # the library's many error types: any refusal counts
        return None


def write_header(f: Path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def value_bytes(dtype: str, value: float) -> bytes:
    return torch.tensor([value]).to(FLOATS[dtype]).view(torch.uint8).numpy().tobytes()


class Sandbox:
    """ROOT/src (a private copy of a fixture) and ROOT/out; damage one file, run, check, restore."""

    def __init__(self, fixture: Path, root: Path):
        self.root = root
        self.src = root / "src"
        self.out = root / "out"
        shutil.copytree(fixture, self.src)
        self.pristine = {p.name: p.read_bytes() for p in self.src.iterdir() if p.is_file()}
        self.shards = sorted(n for n in self.pristine if n.endswith(".safetensors"))

    def restore(self) -> None:
        shutil.rmtree(self.out, ignore_errors=True)
        for p in self.src.iterdir():
            if p.name not in self.pristine:
                p.unlink()
        for name, data in self.pristine.items():
            if (self.src / name).read_bytes() != data:
                (self.src / name).write_bytes(data)

    def convert_checked(self, **kw) -> KConvertError | None:
        """Convert src -> out; assert nothing outside out changed and no complete-looking out on failure."""
        before = snapshot(self.root, skip=self.out)
        err = convert(self.src, self.out, **kw)
        assert snapshot(self.root, skip=self.out) == before, "a file outside OUT was written or changed"
        if err is not None:
            assert not (self.out / MANIFEST).exists(), "kconvert.json left after a failed conversion"
        return err

