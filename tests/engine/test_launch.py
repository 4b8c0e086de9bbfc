"""`python -m engine.chat` and `kconvert load --warmup` on a tp-2 conversion start their own ranks (no
torchrun): the ranks cooperate (same answer as tp 1), a failing rank or Ctrl-C ends every rank with one
line, and torchrun keeps working."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from helpers import ROOT, run_cli

PROMPT = ["--prompt", "The quick brown fox", "--max-new-tokens", "6", "--dtype", "fp32"]


@pytest.fixture(scope="module")
def conversions(conversion):
    return {f"tp{tp}": conversion("tiny-k25-dsv32", tp=tp) for tp in (1, 2)}


@pytest.fixture(scope="module")
def tp1_answer(conversions):
    one = chat(conversions["tp1"], *PROMPT)
    assert one.returncode == 0, one.stderr
    return answer(one.stdout)


def chat(*args, stdin=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "engine.chat", *map(str, args)], cwd=ROOT, input=stdin,
                          capture_output=True, text=True, timeout=timeout)


def answer(stdout: str) -> str:
    return stdout.rsplit("\n[TTFT", 1)[0]


def processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes that name `text` (ranks left behind would)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmd and "pytest" not in cmd:
            out.append(cmd)
    return out


def assert_no_ranks_left(path) -> None:
    deadline = time.monotonic() + 10
    while processes_mentioning(str(path)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not processes_mentioning(str(path))


def test_chat_on_tp2_starts_its_ranks_and_matches_tp1(conversions, tp1_answer):
    two = chat(conversions["tp2"], *PROMPT)
    assert two.returncode == 0 and "6 tokens" in two.stdout and two.stderr == "", two.stderr
    assert answer(two.stdout) == tp1_answer  # greedy, fp32: the two ranks really split the model
    assert_no_ranks_left(conversions["tp2"])


def test_a_failing_rank_ends_every_rank_with_one_line(conversions, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(conversions["tp2"], bad)
    victim = bad / "rank-001" / "layer-0001.safetensors"
    victim.write_bytes(victim.read_bytes()[:100])  # only rank 1 can notice
    p = chat(bad, *PROMPT)
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert lines[0].startswith("error: rank 1: ") and str(victim) in lines[0], lines[0]
    assert_no_ranks_left(bad)


def test_ctrl_c_ends_every_rank(conversions):
    # SIGINT as a terminal leaves it, however the suite was started (a shell's background job ignores SIGINT, and
    # a child inherits that: Python then installs no KeyboardInterrupt handler)
    p = subprocess.Popen([sys.executable, "-m", "engine.chat", str(conversions["tp2"]), "--max-new-tokens", "3"],
                         cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    p.stdin.write("hello\n")
    p.stdin.flush()
    seen, deadline = "", time.monotonic() + 240
    while "TTFT" not in seen and time.monotonic() < deadline:  # one answer: both ranks are up and in lock-step
        seen += os.read(p.stdout.fileno(), 4096).decode()
    assert "TTFT" in seen, seen
    p.send_signal(signal.SIGINT)  # what the terminal sends on Ctrl-C, to rank 0 (the other rank has its own session)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130 and err.strip() == "interrupted", (p.returncode, err)
    assert (seen + out).endswith("\n"), (seen + out)[-80:]  # the "> " line is ended: "interrupted" is on its own
    assert_no_ranks_left(conversions["tp2"])


def test_nproc_that_does_not_match_is_one_line(conversions):
    p = chat(conversions["tp2"], "--nproc", "1", *PROMPT)
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    assert p.returncode == 2 and len(lines) == 1 and "kconvert.json" in lines[0] and "tp 2" in lines[0], p.stderr


def test_load_warmup_without_rank_runs_every_rank(conversions):
    p = run_cli("load", conversions["tp2"], "--warmup", "1", "--device", "cpu", "--kv-dtype", "fp8", "--json",
                timeout=300)
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)
    assert report["rank"] == 0 and report["seconds"]["warmup"] > 0
    sec = report["seconds"]  # waiting for the other rank to start is its own phase, not part of "open"
    assert sec["start_ranks"] > 0 and sec["start_ranks"] > sec["open"], sec
    assert abs(sec["ready"] - (sec["start_ranks"] + sec["open"] + sec["load"] + sec["warmup"])) < 1e-6
    assert report["kv"] == {"dtype": "fp8", "budget": None, "device_budget": None}  # the KV options echoed
    q = run_cli("load", conversions["tp2"], "--warmup", "1", "--rank", "1", "--device", "cpu")
    assert q.returncode == 2 and "drop --rank" in q.stderr and "Traceback" not in q.stderr, q.stderr


def test_torchrun_still_works(conversions, tp1_answer):
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "engine.chat",
                        str(conversions["tp2"]), *PROMPT], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr
    assert answer(p.stdout) == tp1_answer


def test_help_documents_the_launcher():
    p = chat("--help")
    assert p.returncode == 0 and "--nproc" in p.stdout and "torchrun" in p.stdout and "Ctrl-C" in p.stdout


def test_the_runs_last_line_ends_an_answer_left_mid_line(monkeypatch, capsys):
    """A rank's error arriving while rank 0 streams an answer starts a line of its own, and an answer that
    ended its line gets no blank line before it."""
    from engine.runtime import launch

    monkeypatch.setattr(launch, "_cursor", None)  # restored at teardown: later tests print to a plain stdout
    for ended in (False, True):
        monkeypatch.setattr(launch, "_said_once", False)
        out = launch.tracked_stdout()
        out.write("def main():\n    return fa" + ("\n" if ended else ""))
        assert launch.say_once("kconvert: rank 1: killed by signal 9") and not launch.say_once("a second line")
        cap = capsys.readouterr()
        assert cap.out == "def main():\n    return fa\n" and cap.err == "kconvert: rank 1: killed by signal 9\n"
