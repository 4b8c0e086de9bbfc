"""Start the ranks of a multi-process run from one command, so `python -m engine.chat OUT` on a tp x pp
conversion needs no torchrun (on one machine; across machines torchrun starts them: docs/COMMANDS.md "Multi-node").

This process becomes rank 0 and keeps the terminal (stdin, stdout, Ctrl-C); ranks 1..N-1 (N = tp x pp) are the same
command started again with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set, as torchrun would, in
their own session (Ctrl-C reaches rank 0 only), stdin closed, stderr kept for error reports. One process
per rank on CPU (gloo), one per device on an accelerator (nccl / mccl, device LOCAL_RANK).

Ending: when rank 0 finishes, the others finish with it (they follow its broadcasts) and are waited for;
when rank 0 fails or is interrupted, they are stopped at once; when another rank fails, rank 0 is given a
moment to report the same error itself, else the failing rank's last line is printed, once, and every
rank ends with its exit code. Under torchrun (WORLD_SIZE already set) nothing is launched.
"""

from __future__ import annotations

import collections
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from kconvert.distributed import StoppedWatch
from kconvert.errors import DeviceError, KConvertError, UsageError

PARENT_ENV = "KCONVERT_LAUNCHER_PID"  # set in the ranks this module starts
REPORT_GRACE_S = 1.0  # a rank's failure waits this long for rank 0 to report the same error itself
FINISH_WAIT_S = 30.0  # after rank 0 succeeds, how long the others may take to finish
STOP_WAIT_S = 3.0  # SIGTERM, then SIGKILL after this long

_current: "_Ranks | None" = None  # the ranks this process started, if any
_said = threading.Lock()
_said_once = False


class LineCursor:
    """Rank 0's stdout as the streamed answer (or chat's "> " prompt, which sets mid_line) leaves it: the run's
    last line (an error from any rank, "interrupted", on stderr) first ends a line left open instead of gluing
    onto it."""

    def __init__(self, stream):
        self.stream, self.mid_line = stream, False

    def write(self, text: str) -> int:
        if text:
            self.mid_line = not text.endswith("\n")
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


_cursor: LineCursor | None = None


def tracked_stdout() -> LineCursor:
    """sys.stdout for a streamed answer, remembered so that say_once can end its open line."""
    global _cursor
    _cursor = LineCursor(sys.stdout)
    return _cursor


def say_once(line: str, file=None) -> bool:
    """Print the one line that ends a run (an error, 'interrupted'); later calls print nothing."""
    global _said_once
    with _said:
        if _said_once:
            return False
        _said_once = True
    if _cursor is not None and _cursor.mid_line:
        _cursor.write("\n")
        _cursor.flush()
    out = file or sys.stderr
    print(line, file=out, flush=True)
    return True


def under_launcher() -> bool:
    """torchrun (or this module, in a child rank) already set up the ranks."""
    return "WORLD_SIZE" in os.environ


def world_for(conv, nproc: int | None, device: str) -> int:
    """How many ranks to run for the opened conversion `conv` (kconvert.load.loader.ConvertedCheckpoint): its
    world size (tp x pp); --nproc may only repeat it, and accelerators need one device per rank. Everything
    is checked here, before a single rank is started (a wrong --nproc used to spawn them all first)."""
    from kconvert.disk_format.ranks import resolve_rank

    world = conv.catalog.world_size if nproc is None else nproc
    if world < 1:
        raise UsageError(f"--nproc must be at least 1, got {world}")
    resolve_rank(conv.catalog, conv.root, world_size=world)  # the conversion's world bounds --nproc
    kind = device.split(":")[0]
    if world > 1 and kind != "cpu" and not under_launcher():
        import torch

        count = torch.get_device_module(kind).device_count() if hasattr(torch, kind) else 0
        if count < world:
            raise DeviceError(f"{world} ranks need {world} {kind} devices (one each); this machine has {count}: "
                              f"use --device cpu, or torchrun across machines")
    return world


def rank_device(device: str) -> str:
    """The device of this rank: an accelerator rank takes device LOCAL_RANK whatever index was given."""
    kind = device.split(":")[0]
    if kind != "cpu" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return f"{kind}:{os.environ.get('LOCAL_RANK', '0')}"
    return device


def run(world: int, command: list[str], body: Callable[[], int], device: str = "cpu", prefix: str = "error") -> int:
    """Run `body()` (which returns an exit code) as rank 0 of `world` ranks; `command` starts one more rank.
    Another rank's failure is reported as "{prefix}: rank N: {its last line}".

    Alone (world 1) or under a launcher, body() just runs here."""
    if world <= 1 or under_launcher():
        if os.environ.get(PARENT_ENV):
            _die_with_parent(int(os.environ[PARENT_ENV]))
        return body()
    global _current
    ranks = _current = _Ranks(world, command, device, prefix)
    ranks.start()
    try:
        rc = body()
    except Exception as e:
        # a collective fails when another rank died: that rank's error is the one to show
        peer = None if isinstance(e, KConvertError) else peer_failure()
        ranks.stop()
        if peer is not None:
            return peer
        raise
    except BaseException:
        ranks.stop()
        raise
    if rc != 0:
        ranks.stop()
        return rc
    return ranks.finish()


class _Ranks:
    def __init__(self, world: int, command: list[str], device: str, prefix: str):
        self.world, self.command, self.device, self.prefix = world, command, device, prefix
        self.procs: dict[int, subprocess.Popen] = {}
        self.tails: dict[int, collections.deque] = {}
        self.closing = threading.Event()

    def start(self) -> None:
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(self.world),
               "LOCAL_WORLD_SIZE": str(self.world), PARENT_ENV: str(os.getpid())}
        if self.device.split(":")[0] == "cpu":  # share the cores instead of each rank taking them all
            threads = max(1, (os.cpu_count() or 1) // self.world)
            env["OMP_NUM_THREADS"] = str(threads)
            import torch

            torch.set_num_threads(threads)
        os.environ.update(env, RANK="0", LOCAL_RANK="0")
        for r in range(1, self.world):
            p = subprocess.Popen(self.command, env={**os.environ, "RANK": str(r), "LOCAL_RANK": str(r)},
                                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                 start_new_session=True)
            self.procs[r] = p
            self.tails[r] = collections.deque(maxlen=20)
            threading.Thread(target=self._collect, args=(r,), daemon=True).start()
        threading.Thread(target=self._watch, daemon=True).start()

    def _collect(self, r: int) -> None:
        for raw in self.procs[r].stderr:
            line = raw.decode("utf-8", "replace").strip()
            if line:
                self.tails[r].append(line)

    def _watch(self) -> None:
        """Another rank failed, or is frozen (stopped by a signal): rank 0 is likely stuck in a collective
        waiting for it, so end the run here."""
        stopped = StoppedWatch()
        while not self.closing.is_set():
            r = stopped.frozen({r: p.pid for r, p in self.procs.items() if p.poll() is None})
            if r is not None and say_once(f"{self.prefix}: rank {r} is frozen (stopped by a signal for "
                                          f"{stopped.limit_s:.0f} s: SIGSTOP or a debugger): every rank is stopped"):
                self.stop()
                sys.stdout.flush()
                os._exit(1)
            for r, p in self.procs.items():
                rc = p.poll()
                if rc is None or rc == 0:
                    continue
                if self.closing.wait(REPORT_GRACE_S):
                    return  # rank 0 is ending the run (and reported why)
                time.sleep(0.1)  # let the reader take the last line
                if say_once(f"{self.prefix}: rank {r}: {self._last_line(r, rc)}"):
                    self.stop()
                    sys.stdout.flush()
                    os._exit(rc if 0 < rc < 128 else 1)
                return
            self.closing.wait(0.2)

    def _last_line(self, r: int, rc: int) -> str:
        tail = self.tails[r]
        line = tail[-1] if tail else ""
        for prefix in ("kconvert: ", "error: "):  # the rank's own "kconvert: error: ..." line, without the prefix
            line = line[len(prefix):] if line.startswith(prefix) else line
        if rc < 0:
            name = signal.Signals(-rc).name
            why = f"killed by {name}" + (" (out of memory?)" if name == "SIGKILL" else "")
            return f"{why}: {line}" if line else why
        return line or f"exited with code {rc}"

    def stop(self) -> None:
        self.closing.set()
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + STOP_WAIT_S
        for p in self.procs.values():
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def finish(self) -> int:
        """Rank 0 succeeded: wait for the others; the run's code is the first failure among them."""
        deadline = time.monotonic() + FINISH_WAIT_S
        for p in self.procs.values():
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self.closing.set()
        failed = [(r, p.returncode) for r, p in self.procs.items() if p.returncode not in (0, None)]
        stuck = [r for r, p in self.procs.items() if p.returncode is None]
        self.stop()
        if failed:
            r, rc = failed[0]
            say_once(f"{self.prefix}: rank {r}: {self._last_line(r, rc)}")
            return rc if 0 < rc < 128 else 1
        if stuck:
            say_once(f"{self.prefix}: rank {stuck[0]} did not finish within {FINISH_WAIT_S:.0f} s of rank 0: stopped")
            return 1
        return 0


def peer_failure(wait_s: float = 3.0) -> int | None:
    """Rank 0 hit an unexpected error (typically a collective whose peer died): when one of the ranks this
    process started has failed, or fails within wait_s, report that rank's error instead and return its
    exit code; None when none did (or when this process started no ranks)."""
    ranks = _current
    if ranks is None:
        return None
    deadline = time.monotonic() + wait_s
    while True:
        for r, p in ranks.procs.items():
            rc = p.poll()
            if rc not in (None, 0):
                time.sleep(0.1)  # let the reader take the last line
                say_once(f"{ranks.prefix}: rank {r}: {ranks._last_line(r, rc)}")
                return rc if 0 < rc < 128 else 1
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent(parent: int) -> None:
    """A rank we started ends with the launcher, even if the launcher is killed outright (Linux)."""
    try:
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the launcher died before prctl took effect
        os._exit(1)
