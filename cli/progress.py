"""Rich progress for long library calls: the library emits events, this turns them into a bar."""

from __future__ import annotations

import contextlib

from rich.progress import (BarColumn, DownloadColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn,
                           TimeRemainingColumn, TransferSpeedColumn)
from rich.text import Text


class FlooredPercent(ProgressColumn):
    """The percentage rounded down: "100%" only once everything is counted (the journalled commands count a
    file's bytes when it is durable), never for 99.6 %."""

    def render(self, task) -> Text:
        return Text("" if task.total is None else f"{int(task.percentage):>3d}%", style="progress.percentage")


@contextlib.contextmanager
def byte_progress(description: str, *, enabled: bool = True, unit: str = "bytes", speed: bool = True):
    """Yields a callback `cb(event, **kw)` understanding ("start", total=[, restart=True]), ("advance", n=),
    ("file", path=), ("phase", name=); other events (("working", n=): bytes in flight) are not counted.
    `unit="items"` counts things (prompts, layers) instead of bytes; `speed=False` leaves the running rate out
    (a command that prints its own rate at the end)."""
    if not enabled:
        yield lambda *a, **k: None
        return
    amount = [DownloadColumn(), *([TransferSpeedColumn()] if speed else [])] if unit == "bytes" else [MofNCompleteColumn()]
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), FlooredPercent(), *amount,
                  TimeRemainingColumn(), TextColumn("{task.fields[note]}"), transient=False) as bar:
        task = bar.add_task(description, total=None, note="")

        def cb(event: str, **kw) -> None:
            if event == "start":  # restart=True: a new phase counts from 0
                bar.update(task, total=kw["total"], **({"completed": 0} if kw.get("restart") else {}))
            elif event == "advance":
                bar.advance(task, kw["n"])
            elif event == "file":
                bar.update(task, note=kw["path"])
            elif event == "phase":
                bar.update(task, description=kw["name"])

        yield cb
