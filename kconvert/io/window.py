"""A bounded window of work ahead of one consumer: submit up to `window` items to a pool, hand back
their results strictly in order. Memory is the window's results, never the whole stream.

    with ordered_window(pool, work, items, window=workers + 1) as results:
        for item, result in results:
            ...

Before the consumer waits for item i, items i .. i + window - 1 have been submitted. When the
consumer stops early or anything raises (a worker's error, the consumer's own, Ctrl-C), the items
not yet started are cancelled, the ones running are waited for (so nothing outlives the buffers or
files they use), and `discard(result)` is called on each finished one never handed out (a caller
removes the temporaries it made).
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, Future
from typing import Any


@contextlib.contextmanager
def ordered_window(pool: Executor, work: Callable[[Any], Any], items: Iterable, window: int,
                   discard: Callable[[Any], None] | None = None):
    """Yields an iterator of (item, work(item)) in the order of `items`, at most `window` in flight."""
    results = _run(pool, work, items, max(1, window), discard)
    try:
        yield results
    finally:
        results.close()  # the consumer left early or raised: cancel, wait, discard


def _run(pool: Executor, work, items: Iterable, window: int, discard) -> Iterator[tuple[Any, Any]]:
    ahead: deque[tuple[Any, Future]] = deque()
    queued = iter(items)
    try:
        while True:
            while len(ahead) < window and (nxt := next(queued, _END)) is not _END:
                ahead.append((nxt, pool.submit(work, nxt)))
            if not ahead:
                return
            yield _take(ahead)  # no reference kept here: the consumer decides when the result goes
    except BaseException:
        for _, f in ahead:
            f.cancel()
        for _, f in ahead:
            if not f.cancelled() and f.exception() is None and discard is not None:  # exception() waits
                discard(f.result())
        raise


def _take(ahead: deque) -> tuple[Any, Any]:
    item, fut = ahead.popleft()
    return item, fut.result()


_END = object()
