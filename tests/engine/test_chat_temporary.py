"""Issue 42, class 5: `engine.chat SRC` on a source converts it into a temporary tp 1 directory as large as the
model. It used to live in $TMPDIR/kconvert-chat-* and stay there after a SIGTERM or SIGKILL (during the conversion
or the generation), never reclaimed, and a full disk's message named that path with "re-run the same command to
resume". Now it is a work directory (kconvert/io/workdir.py): removed on SIGTERM (exit 130), reclaimed after a
SIGKILL by the next run, and errors inside it are told without it. Each case runs chat in a subprocess with a
private TMPDIR; the signal is sent by the process itself at a chosen point (no timer races)."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import textwrap

import pytest

from helpers import ROOT


def _chat(src, tmpdir, script: str = "", preexec=None) -> subprocess.CompletedProcess:
    code = textwrap.dedent(script) + textwrap.dedent(f"""
        from engine.chat.session import main
        sys.exit(main([{str(src)!r}, "--prompt", "hi", "--max-new-tokens", "2"]))
    """)
    return subprocess.run([sys.executable, "-c", "import os, signal, sys\n" + code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, preexec_fn=preexec, env={**os.environ, "TMPDIR": str(tmpdir)})


def _left(tmpdir) -> list[str]:
    """Everything under TMPDIR but the (empty) work base."""
    return sorted(str(p.relative_to(tmpdir)) for p in tmpdir.rglob("*") if p.name != "kconvert-work")


@pytest.fixture
def tmpdir_(tmp_path):
    d = tmp_path / "tmp"
    d.mkdir()
    return d


SIGTERM_AT = {
    "the conversion": """
        from kconvert.io import safetensors_write as w
        real = w.SafetensorsWriter.__init__
        def opened(self, *a, **k):  # a shard's temporary is open in the conversion
            real(self, *a, **k)
            os.kill(os.getpid(), signal.SIGTERM)
        w.SafetensorsWriter.__init__ = opened
    """,
    "the generation": """
        from engine.chat import session as s
        real = s.Session.turn
        def turn(self, *a, **k):
            os.kill(os.getpid(), signal.SIGTERM)
            return real(self, *a, **k)
        s.Session.turn = turn
    """,
}


@pytest.mark.parametrize("when", list(SIGTERM_AT))
def test_sigterm_removes_the_temporary_conversion(checkpoint, tmpdir_, when):
    p = _chat(checkpoint("tiny-k25-dsv32"), tmpdir_, SIGTERM_AT[when])
    assert p.returncode == 130, (p.returncode, p.stderr)
    assert _left(tmpdir_) == [], when


def test_a_sigkilled_chats_conversion_is_reclaimed_by_the_next_run(checkpoint, tmpdir_):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid no process has now
    stale = tmpdir_ / "kconvert-work" / f"chat-{dead.pid}-abc123" / "tp1"
    stale.mkdir(parents=True)
    (stale / "layer-0001.safetensors").write_bytes(b"\0" * 4096)
    p = _chat(checkpoint("tiny-k25-dsv32"), tmpdir_)
    assert p.returncode == 0, p.stderr
    assert _left(tmpdir_) == []


def test_a_full_disk_is_told_without_the_temporary_path(checkpoint, tmpdir_):
    def one_mib_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))

    p = _chat(checkpoint("tiny-k25-dsv32"), tmpdir_, preexec=one_mib_files)
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert "disk full" in lines[0] and "re-run" not in lines[0] and "tp1" not in lines[0], lines[0]
    assert _left(tmpdir_) == []
