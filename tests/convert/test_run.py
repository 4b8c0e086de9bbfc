"""The pieces shard, export and pack share (their runs end to end: test_shard.py, test_export.py,
test_compressed.py, test_fault_injection_writes.py). kconvert.io.window.ordered_window, the bounded
look-ahead also used by compress_file and the loader: results in order, never more than the window in
flight, and on an early stop or an error the queued work cancelled, the running work waited for and the
finished results discarded. RunResult: one flat JSON summary, the command's own figures included."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kconvert.convert.run import ExportFigures, PackFigures, Run, RunResult, ShardFigures
from kconvert.errors import KConvertError
from kconvert.io.window import ordered_window


def test_results_in_order_and_at_most_the_window_in_flight():
    lock, running, peak = threading.Lock(), [0], [0]

    def work(x):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.002 * (x % 3))  # finish out of order
        return x * x

    got = []
    with ThreadPoolExecutor(4) as pool, ordered_window(pool, work, range(40), 3) as results:
        for x, y in results:
            with lock:
                running[0] -= 1  # handed out: no longer in flight
            got.append((x, y))
    assert got == [(x, x * x) for x in range(40)] and peak[0] == 3


@pytest.mark.parametrize("fail", ["consumer", "worker"])
def test_an_error_discards_every_finished_result_not_handed_out(fail):
    started, discarded, handed = [], [], []

    def work(x):
        started.append(x)
        if fail == "worker" and x == 3:
            raise ValueError(x)
        return x

    with ThreadPoolExecutor(2) as pool, pytest.raises((KeyError, ValueError)):
        with ordered_window(pool, work, range(100), 4, discarded.append) as results:
            for x, _ in results:
                handed.append(x)
                if fail == "consumer" and x == 2:
                    time.sleep(0.2)  # the window's other items finish meanwhile
                    raise KeyError(x)
                if fail == "worker":
                    time.sleep(0.05)
    failed = {3} if fail == "worker" else set()
    assert max(started) < 7 and sorted(discarded) == sorted(set(started) - set(handed) - failed)
    assert discarded  # something was in flight to discard


def test_stopping_early_waits_for_running_work():
    finished, running = [], threading.Event()

    def work(x):
        if x == 1:
            running.set()
            time.sleep(0.1)
        finished.append(x)
        return x

    with ThreadPoolExecutor(1) as pool:
        with ordered_window(pool, work, range(10), 3) as results:
            for _ in results:
                assert running.wait(5)  # item 1 is running: leave while it runs
                break
        assert finished == [0, 1]  # waited for (nothing it uses is freed under it); item 2 never ran


def test_run_result_json_is_flat_with_each_commands_own_figures():
    common = {"out": "out", "files_written": 2, "files_resumed": 0, "bytes_in": 10, "bytes_out": 0, "seconds": 0.0,
              "peak_rss_bytes": 0, "already_complete": False}
    shard = RunResult("out", files_written=2, bytes_in=10, details=ShardFigures({0: 5}))
    assert shard.to_json() == {**common, "per_rank_bytes": {0: 5}}  # processes, calibration: None, left out
    shard.details.processes = 2
    assert shard.to_json() == {**common, "per_rank_bytes": {0: 5}, "processes": 2}
    pack = RunResult("out", files_written=2, bytes_in=10, details=PackFigures("pack", untouched=3))
    assert list(pack.to_json())[len(common):] == ["op", "untouched", "files", "resumed", "plain_bytes", "stored_bytes"]
    assert pack.details.op == "pack" and pack.to_json()["untouched"] == 3
    assert list(RunResult("out", details=ExportFigures("w4a16")).to_json())[len(common):] == [
        "format", "files", "tensors", "quantized", "dequantized", "rounded", "workers"]


def test_a_run_finishes_only_when_every_process_journalled_every_file(tmp_path):
    """The skeleton's contract, without a conversion: a file counts once journalled with its bytes still
    there (any process's journal); a missing one is a one-line error that says to re-run, the marker is
    not written and the journal stays; once all are there, write_last runs and the journal goes."""
    size_of = lambda rec: rec.get("bytes")  # noqa: E731
    run = Run(tmp_path / "out")
    assert not run.prepare({"job": 1}, overwrite=False)  # fresh
    (run.out / "a.bin").write_bytes(b"aa")
    (run.out / "c.bin").write_bytes(b"c")  # journalled with another size below: not done
    with run.log("done-0000.jsonl") as log:
        log.add_all([{"file": "a.bin", "bytes": 2}, {"file": "c.bin", "bytes": 9}])
        run.wrote("a.bin", 2)
    last = []
    with pytest.raises(KConvertError, match=r"^2 files were not produced \(first: b.bin\); re-run to resume$"):
        run.finish(["a.bin", "b.bin", "c.bin"], size_of, last.append)
    assert not last and (run.out / ".kconvert").is_dir()
    (run.out / "b.bin").write_bytes(b"b")
    (run.out / "c.bin").write_bytes(b"c" * 9)
    with run.log("done-0001.jsonl") as log:  # another process
        log.add({"file": "b.bin", "bytes": 1})
    run.finish(["a.bin", "b.bin", "c.bin"], size_of, lambda done: last.append(sorted(done)))
    assert last == [["a.bin", "b.bin", "c.bin"]] and not (run.out / ".kconvert").exists()
    r = run.done()
    assert (r.files_written, r.bytes_in, r.already_complete) == (1, 2, False) and r.seconds > 0
    (run.out / "kconvert.json").write_text(json.dumps({"job": {"job": 1}}))
    again = Run(tmp_path / "out")
    assert again.prepare({"job": 1}, overwrite=False) and again.result.already_complete


def test_the_bar_counts_a_file_when_it_is_durable(checkpoint, tmp_path):
    """shard's and export's bars count each file's bytes as it is journalled (durable), so they reach their total
    with the last file and never before (in-flight work is a separate, uncounted event); the percentage is
    rounded down, so "100%" means everything."""
    from types import SimpleNamespace

    from cli.progress import FlooredPercent
    from kconvert.convert.export.job import ExportJob, export
    from helpers import shard_job
    from kconvert.convert.shard.job import shard

    for run in (lambda cb: shard(shard_job(checkpoint("tiny-k25-dsv32"), tmp_path / "s", tp=2), progress=cb),
                lambda cb: export(ExportJob(str(checkpoint("tiny-k25-dsv32")), str(tmp_path / "e"), "fp8-block",
                                            max_shard_bytes=4_000_000), progress=cb)):
        events = []
        result = run(lambda event, **kw: events.append((event, kw)))
        total = events[0][1]["total"]
        counted = [(i, kw["n"]) for i, (e, kw) in enumerate(events) if e == "advance"]
        files = [i for i, (e, _) in enumerate(events) if e == "file"]
        assert len(counted) == len(files) == result.files_written > 1
        assert all(events[i + 1][0] == "file" for i, _ in counted)  # each count is a durable file's
        assert sum(n for _, n in counted) == total and sum(n for _, n in counted[:-1]) < total
        assert any(e == "working" for e, _ in events)
    assert FlooredPercent().render(SimpleNamespace(total=1000, percentage=99.6)).plain == " 99%"
