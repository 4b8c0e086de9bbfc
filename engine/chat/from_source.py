"""`python -m engine.chat SRC` where SRC is not a converted directory (a source release, a `kconvert export`,
a Hub id): SRC is converted first, through `shard`, into a temporary tp 1 directory removed at exit, as
`kconvert shard SRC OUT --tp 1 --quant Q` would (Q from its quantization_config, export/table.runs_as: a
block-FP8 or int8 checkpoint keeps its format, others run in bf16). Chosen over converting in memory: the
engine then loads exactly what `shard` writes, through the one loader. What it cost (seconds, bytes
written) is said before the chat starts, with the command that makes the conversion once.

The conversion is as large as the model, so it lives where every temporary of kconvert does
(kconvert/io/workdir.py: $TMPDIR/kconvert-work/chat-PID-*): removed however chat ends (SIGTERM too: chat turns it
into Ctrl-C), and a directory left by a SIGKILLed chat is reclaimed by the next run. An error inside it (a full
disk) is told without the temporary path and without "re-run to resume": nothing is left to resume."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Callable, Iterator

from kconvert.disk_format.catalog import MANIFEST
from kconvert.errors import KConvertError, UsageError
from kconvert.io.workdir import base_dir, scrub, work_dir


@contextlib.contextmanager
def converted_dir(path: str, say: Callable[[str], object], nproc: int | None = None) -> Iterator[str]:
    """Yield a converted directory for `path`: itself, or its temporary tp 1 conversion."""
    if (Path(path) / MANIFEST).exists():
        yield path
        return
    from kconvert.convert.export.table import runs_as
    from kconvert.convert.shard.job import ShardJob, shard
    from kconvert.convert.layout import Topology
    from kconvert.quant.policy import QuantPolicy
    from kconvert.source.checkpoint import Checkpoint

    quant = runs_as(Checkpoint.open(path, headers_only=True).quantization_config)
    if nproc not in (None, 1):
        raise UsageError(f"--nproc {nproc} needs a converted directory: kconvert shard {path} OUT --tp {nproc}",
                         file=path)
    with work_dir("chat") as tmp:
        t0 = time.perf_counter()
        try:
            r = shard(ShardJob(path, str(tmp / "tp1"), topology=Topology(tp=1), quant=QuantPolicy(scheme=quant)))
        except KConvertError as e:
            raise scrub(e, tmp, f"converting {path} for chat (under {base_dir()}, removed)") from None
        say(f"{path} is not a converted directory: converted to a temporary tp 1 directory (--quant {quant}) in "
            f"{time.perf_counter() - t0:.1f} s, {r.bytes_out / 1e9:.2f} GB written, removed at exit; "
            f"`kconvert shard {path} OUT --tp 1 --quant {quant}` once saves this at every start")
        try:  # what chat then says of the temporary conversion names the source's files instead
            yield r.out
        except KConvertError as e:
            raise scrub(e, tmp, f"chat on {path} (converted to a temporary directory, removed)",
                        stands_for=(Path(r.out), path), only_if_named=True) from None
