"""Issue 42, classes 7 and 8: the newest options and inputs, typed as a hostile user would. Each is one line,
exit 2, before any work, where they used to be accepted (non-ASCII digits: '٣' read as 3) or end in an internal
error (exit 3: a 10^12-token calibration allocating, a 10^23 seed overflowing the generator)."""

from __future__ import annotations

import os
import shutil

import pytest

from helpers import assert_one_line_error, cli_here


@pytest.mark.parametrize("option, value, needle", [
    ("--calibration-tokens", "٣٣", "ASCII digits"),
    ("--calibration-tokens", "1000000000000", "at most 16777216"),
    ("--calibration-seq", "١٢٨", "ASCII digits"),
    ("--calibration-seq", "1", "at least 2"),
    ("--calibration-seed", "100000000000000000000000", "out of range"),
    ("--calibration-seed", "-1", "at least 0"),
])
def test_calibration_numbers(checkpoint, tmp_path, option, value, needle):
    out = tmp_path / "out"
    p = cli_here("shard", checkpoint("tiny-k25-dsv32"), out, "--tp", "1", "--quant", "int4", "--calibrate", "stdlib",
                 option, value)
    assert_one_line_error(p, option, needle)
    assert not out.exists()


@pytest.mark.parametrize("level", ["٣", "99999999999999999999999", "3.0"])
def test_compress_level_in_ascii_digits(conversion, tmp_path, level):
    out = tmp_path / "c"  # a copy: a level read as 3 would pack it
    shutil.copytree(conversion("tiny-k25-dsv32", tp=2, quant="fp8"), out)
    assert_one_line_error(cli_here("pack", out, "--compress", f"zstd:{level}"), "zstd:LEVEL")
    assert not (out / ".kconvert").exists()


@pytest.mark.parametrize("threshold, needle", [("same_top1_pct=200", "at most 100"), ("ppl_ratio=0.5", "at least 1"),
                                              ("faithful.same_top1_pct=101", "at most 100"),
                                              ("draft.acceptance_drop=3", "at most 1"), ("mean_kld=-1", "at least 0")])
def test_a_threshold_that_can_never_be_met_is_refused(conversion, threshold, needle):
    """A limit outside what its statistic can be (a share over 100 %, a perplexity ratio under 1) would make every
    verify PASS or FAIL whatever the conversion: refused before any work."""
    assert_one_line_error(cli_here("verify", conversion("tiny-k25-dsv32", tp=1), "--threshold", threshold),
                          "--threshold", needle)


def _nest(root, depth: int) -> None:
    """`depth` directories one inside the other under root, a text file at the bottom (made relative to a
    descriptor: the whole path is longer than PATH_MAX)."""
    import os

    root.mkdir()
    cur = os.open(root, os.O_RDONLY)
    for _ in range(depth):
        os.mkdir("d", dir_fd=cur)
        nxt = os.open("d", os.O_RDONLY, dir_fd=cur)
        os.close(cur)
        cur = nxt
    with open(os.open("t.txt", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=cur), "w") as f:
        f.write("some text " * 200)
    os.close(cur)


def _unnest(root) -> None:
    """Remove _nest's tree bottom-up without recursing (shutil.rmtree recurses once per level)."""
    import os

    fds = [os.open(root, os.O_RDONLY)]
    while "d" in os.listdir(fds[-1]):
        fds.append(os.open("d", os.O_RDONLY, dir_fd=fds[-1]))
    os.unlink("t.txt", dir_fd=fds[-1])
    for parent, child in zip(reversed(fds[:-1]), reversed(fds[1:])):
        os.close(child)
        os.rmdir("d", dir_fd=parent)
    os.close(fds[0])


BAD_DATA = {  # calibration data that used to end in an internal error (exit 3)
    "JSONL nested 200k deep": ("d.jsonl", lambda p: p.write_text('{"text": ' + "[" * 200_000 + "]" * 200_000 + "}\n"),
                               "nested deeper than 64"),
    "a 5000-digit number": ("n.jsonl", lambda p: p.write_text('{"text": "hi", "n": ' + "9" * 5000 + "}\n"),
                            "line 1 is not valid JSON"),
    "a lone surrogate": ("s.jsonl", lambda p: p.write_text('{"text": "' + "some words " * 100 + '\\ud800"}\n'),
                         "lone surrogate"),
    "a directory nested 1500 deep": ("nest", lambda p: _nest(p, 1500), "deeper than 64 levels"),
}


@pytest.mark.parametrize("what", list(BAD_DATA))
def test_bad_calibration_data_is_one_line(checkpoint, tmp_path, what):
    name, make, needle = BAD_DATA[what]
    make(tmp_path / name)
    out = tmp_path / "out"
    p = cli_here("shard", checkpoint("tiny-k25-dsv32"), out, "--tp", "1", "--quant", "int4", "--calibrate",
                 tmp_path / name, "--calibration-tokens", "64", "--calibration-seq", "32")
    try:
        assert_one_line_error(p, name, needle)
        assert not (out / "kconvert.json").exists()
    finally:
        if name == "nest":
            _unnest(tmp_path / name)


@pytest.mark.parametrize("command", ["shard", "export"])
def test_out_inside_the_calibration_directory_is_refused(checkpoint, tmp_path, command):
    """A rerun read OUT's own JSON as calibration text and then found OUT 'a different conversion'."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("some words to calibrate on " * 100)
    out = data / "sub" / "out"
    args = ("--tp", "1", "--quant", "int4") if command == "shard" else ("--format", "w4a16")
    p = cli_here(command, checkpoint("tiny-k25-dsv32"), out, *args, "--calibrate", data)
    assert_one_line_error(p, "OUT lies inside the --calibrate directory")
    assert not out.exists()


def test_sigterm_of_export_leaves_no_temporary_in_out(checkpoint, tmp_path):
    """SIGTERM while a shard is being written used to end the process on the spot, leaving `.NAME.tmp-PID` in OUT
    until the next run; now it is Ctrl-C's path (exit 130) and the temporary goes. The signal is sent by the
    export itself, after its first tensor is written: no race with a timer."""
    import subprocess
    import sys
    import textwrap

    from helpers import ROOT

    out = tmp_path / "out"
    script = textwrap.dedent(f"""
        import os, signal, sys
        from kconvert.io import safetensors_write as w
        real = w.SafetensorsWriter.write
        def write(self, *a, **k):
            real(self, *a, **k)
            os.kill(os.getpid(), signal.SIGTERM)
        w.SafetensorsWriter.write = write
        from cli.main import main
        sys.exit(main(["export", {str(checkpoint("tiny-k25-dsv32"))!r}, {str(out)!r}, "--format", "w4a16"]))
    """)
    p = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 130, (p.returncode, p.stderr)
    assert not [f.name for f in out.rglob("*") if ".tmp-" in f.name]


@pytest.mark.parametrize("context", ["100000000000000", "2048M"])
def test_plan_refuses_a_context_past_any_model(context):
    """`plan --context 10^14` was planned (with a warning); past 2^30 tokens (16x the largest
    max_position_embeddings a config may declare) it is refused."""
    assert_one_line_error(cli_here("plan", "k25-dsv32-3t", "--tp", "8", "--context", context), "past 1024M tokens")


@pytest.fixture(scope="module")
def w4a16(checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "w4a16"
    assert cli_here("export", checkpoint("tiny-k25-dsv32"), out, "--format", "w4a16").returncode == 0
    return out


def _set(qc: dict, what: str) -> None:
    if what == "quant_method":
        qc["quant_method"] = "bogus"
    elif what == "num_bits":
        next(iter(qc["config_groups"].values()))["weights"]["num_bits"] = 3
    else:
        qc["config_groups"] = {}


@pytest.mark.parametrize("what, needle", [("quant_method", "quant_method = 'bogus'"), ("num_bits", "num_bits = 3"),
                                          ("config_groups", "at least one group")])
def test_an_exports_quantization_config_is_validated(w4a16, tmp_path, what, needle):
    """An export's quantization_config edited to a method, bit width or group list kconvert does not read was
    accepted (inspect, shard, chat read the tensors by name alone); now one line naming the field."""
    import json

    out = tmp_path / "x"
    shutil.copytree(w4a16, out)
    config = json.loads((out / "config.json").read_text())
    for c in (config, config.get("text_config") or {}):
        if c.get("quantization_config"):
            _set(c["quantization_config"], what)
    (out / "config.json").write_text(json.dumps(config))
    for args in (("inspect", out), ("shard", out, tmp_path / "o", "--tp", "1")):
        assert_one_line_error(cli_here(*args), "config.json", needle)


@pytest.mark.parametrize("args, needle", [(("--layers", "1000000000"), "at most 1024"),
                                          (("--layers", "1024"), "past the 262144"),
                                          (("--experts", "٣"), "ASCII digits")])
def test_topology_fixture_sizes_are_bounded(tmp_path, args, needle):
    """`kconvert fixture topo-k25 --layers 1000000000` ended in MemoryError (exit 3)."""
    assert_one_line_error(cli_here("fixture", "topo-k25", tmp_path / "t", *args), needle)
    assert not (tmp_path / "t").exists()


def test_calibration_text_reaches_the_tokenizer_in_bounded_pieces(tmp_path):
    """Class 6: one long run without whitespace (300 MB) went to the tokenizer whole, which asked for 10-64 GB
    and aborted (SIGABRT). Every piece it is handed is now at most ENCODE_CHUNK characters."""
    from kconvert.source import calibration_data as cd

    (tmp_path / "run.txt").write_text("x" * (3 * cd.ENCODE_CHUNK + 5))
    pieces = []

    def encode(text):
        pieces.append(len(text))
        return [1] * (len(text) // 4)

    windows, _ = cd.calibration_windows(str(tmp_path / "run.txt"), encode, tokens=64, seq=32)
    assert windows.shape == (2, 32) and max(pieces) <= cd.ENCODE_CHUNK and sum(pieces) == 3 * cd.ENCODE_CHUNK + 5


def test_pieces_encode_ordinary_text_as_whole(checkpoint):
    """Pieces end before a space that follows a word: the tokenizer's own pre-split boundary, so ordinary text
    gives the ids of one whole encode (small pieces here, to cut many times)."""
    from kconvert.source.calibration_data import encode_chunked, read_documents
    from kconvert.source.tokenizer import load_kimi_tokenizer

    enc = load_kimi_tokenizer(checkpoint("tiny-k25-dsv32"))
    text = "\n\n".join(read_documents("stdlib"))
    whole = enc.encode(text, allowed_special="all")
    assert encode_chunked(text, lambda t: enc.encode(t, allowed_special="all"), 4096) == whole


def test_calibration_data_is_bounded_in_total(tmp_path, monkeypatch):
    from kconvert.errors import UsageError
    from kconvert.source import calibration_data as cd

    monkeypatch.setattr(cd, "MAX_DATA", 1000)
    for i in range(3):
        (tmp_path / f"{i}.txt").write_text("word " * 100)
    with pytest.raises(UsageError, match="over 0 MiB of text: pass a subset"):
        cd.read_documents(str(tmp_path))


def test_a_surviving_torchrun_worker_names_its_peer_not_an_internal_error(checkpoint, tmp_path):
    """Class 7: when one worker of `torchrun ... kconvert shard` is killed, the other's next collective fails in
    gloo ("Connection closed by peer"), which it reported as an internal error (exit 3). Two workers are started
    here as torchrun starts them (RANK, WORLD_SIZE, MASTER_*); worker 1 ends itself right after joining."""
    import socket
    import subprocess
    import sys
    import textwrap

    from helpers import ROOT

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["shard", str(checkpoint("tiny-k25-dsv32")), str(tmp_path / "out"), "--tp", "2", "--quant", "fp8"]
    script = textwrap.dedent(f"""
        import os, sys
        from kconvert import distributed
        if os.environ["RANK"] == "1":
            join = distributed.Group.from_env.__func__
            def joined_then_killed(cls, *a, **k):
                join(cls, *a, **k)
                os._exit(9)
            distributed.Group.from_env = classmethod(joined_then_killed)
        from cli.main import main
        sys.exit(main({args!r}))
    """)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
           "LOCAL_WORLD_SIZE": "2"}
    procs = [subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in (0, 1)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert procs[1].returncode == 9
    lines = [l for l in outs[0][1].splitlines() if l.strip()]
    assert procs[0].returncode == 1 and len(lines) == 1, (procs[0].returncode, outs[0][1][-2000:])
    assert "rank 0: another process of this run ended first" in lines[0] and "internal" not in lines[0], lines[0]
