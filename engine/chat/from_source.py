"""`python -m engine.chat SRC` where SRC is not a converted directory (a source release, a `kconvert export`,
a Hub id): SRC is converted first, through `shard`, into a temporary tp 1 directory removed at exit, as
`kconvert shard SRC OUT --tp 1 --quant Q` would (Q from its quantization_config, export_table.runs_as: a
block-FP8 or int8 checkpoint keeps its format, others run in bf16). Chosen over converting in memory: the
engine then loads exactly what `shard` writes, through the one loader. What it cost (seconds, bytes
written) is said before the chat starts, with the command that makes the conversion once."""

from __future__ import annotations

import contextlib
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

from kconvert.converted.catalog import MANIFEST
from kconvert.errors import UsageError


@contextlib.contextmanager
def converted_dir(path: str, say: Callable[[str], object], nproc: int | None = None) -> Iterator[str]:
    """Yield a converted directory for `path`: itself, or its temporary tp 1 conversion."""
    if (Path(path) / MANIFEST).exists():
        yield path
        return
    from kconvert.convert.export_table import runs_as
    from kconvert.convert.shard import ShardJob, shard
    from kconvert.source.checkpoint import Checkpoint

    quant = runs_as(Checkpoint.open(path, headers_only=True).quantization_config)
    if nproc not in (None, 1):
        raise UsageError(f"--nproc {nproc} needs a converted directory: kconvert shard {path} OUT --tp {nproc}",
                         file=path)
    with tempfile.TemporaryDirectory(prefix="kconvert-chat-") as tmp:
        t0 = time.perf_counter()
        r = shard(ShardJob(path, str(Path(tmp) / "tp1"), tp=1, quant=quant))
        say(f"{path} is not a converted directory: converted to a temporary tp 1 directory (--quant {quant}) in "
            f"{time.perf_counter() - t0:.1f} s, {r.bytes_out / 1e9:.2f} GB written, removed at exit; "
            f"`kconvert shard {path} OUT --tp 1 --quant {quant}` once saves this at every start")
        yield r.out
