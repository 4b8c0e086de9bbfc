"""`kconvert pack --rank R` / `unpack --rank R`: a node compresses its own share of a converted directory, reading
only its rank's tensor list, on a copy that holds nothing of the other ranks; unpacking it gives the exact bytes
back (kconvert.json included). Only one pack runs on a directory at a time: a pack of other ranks, the loader and
verify-files name the unfinished command, its --rank included."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import assert_one_line_error, cli_here
from kconvert.convert.pack import pack

RANK1 = "rank-001/layer-0001.safetensors"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def tp2(conversion, tmp_path):
    out = tmp_path / "tp2"
    shutil.copytree(conversion("tiny-k25-dsv32", tp=2, quant="fp8"), out)
    return out


def _stored(out) -> dict[str, bool]:
    return {rel: bool(rec.get("stored")) for rel, rec in json.loads((out / "kconvert.json").read_text())["files"].items()}


def _snapshot(out) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_a_node_packs_and_unpacks_its_own_rank_without_the_others(tp2):
    shutil.rmtree(tp2 / "rank-000")  # a node's copy: kconvert.json and its own rank only (its list included)
    before = _snapshot(tp2)
    r = cli_here("pack", tp2, "--rank", "1", "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    stored = _stored(tp2)
    assert got["files"] == sum(rel.startswith("rank-001/") for rel in stored) > 0
    assert all(v == rel.startswith("rank-001/") for rel, v in stored.items())  # rank 0's records untouched
    assert sum(p.stat().st_size for p in (tp2 / "rank-001").glob("*.safetensors")) < \
        sum(len(b) for rel, b in before.items() if rel.endswith(".safetensors"))
    assert cli_here("verify-files", tp2, "--rank", "1").returncode == 0
    assert cli_here("load", tp2, "--rank", "1", "--device", "cpu", "--verify").returncode == 0
    assert "already" in cli_here("pack", tp2, "--rank", "1").stdout  # nothing left for rank 1
    assert cli_here("unpack", tp2, "--rank", "1").returncode == 0
    assert _snapshot(tp2) == before  # every byte back, kconvert.json included


def test_ranks_packed_in_turn_make_the_whole_directory_packed(tp2):
    assert cli_here("pack", tp2, "--rank", "1").returncode == 0
    r = pack(tp2)  # the rest: rank 1's files are left as they are
    stored = _stored(tp2)
    assert r.details.untouched == sum(rel.startswith("rank-001/") for rel in stored)
    assert r.details.files == len(stored) - r.details.untouched and all(stored.values())
    assert cli_here("verify-files", tp2).returncode == 0


def test_an_unfinished_rank_pack_is_named_with_its_rank_and_resumes(tp2):
    files = [rel for rel in json.loads((tp2 / "kconvert.json").read_text())["files"] if rel.startswith("rank-001/")]

    def die_after_one(event, **kw):
        if event == "file" and kw["path"] == files[0]:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        pack(tp2, ranks=[1], progress=die_after_one)
    unfinished = f"kconvert pack {tp2} --rank 1"
    assert_one_line_error(cli_here("pack", tp2, "--rank", "0"), f"re-run `{unfinished}`")  # one pack at a time
    assert_one_line_error(cli_here("pack", tp2), f"re-run `{unfinished}`")
    assert_one_line_error(cli_here("unpack", tp2, "--rank", "1"), f"re-run `{unfinished}`")
    assert_one_line_error(cli_here("verify-files", tp2), f"re-run `{unfinished}`")
    r = pack(tp2, ranks=[1])
    assert (r.details.resumed, r.details.files) == (1, len(files) - 1)
    assert cli_here("pack", tp2, "--rank", "0").returncode == 0 and all(_stored(tp2).values())


def test_a_damaged_file_names_the_rank_commands_and_a_rank_out_of_range_is_refused(tp2):
    data = (tp2 / RANK1).read_bytes()
    (tp2 / RANK1).write_bytes(data[:-1] + bytes([data[-1] ^ 0x55]))
    assert_one_line_error(cli_here("pack", tp2, "--rank", "1"), RANK1, "checksum mismatch",
                          f"re-run `kconvert pack {tp2} --rank 1`", f"`kconvert unpack {tp2} --rank 1`")
    assert not (tp2 / ".kconvert").exists()
    assert_one_line_error(cli_here("pack", tp2, "--rank", "2"), "--rank 2", "ranks 0..1", "kconvert.json")
    assert_one_line_error(cli_here("unpack", tp2, "--rank", "5"), "--rank 5", "ranks 0..1")


def test_pack_and_unpack_never_import_torch(tp2):
    """A node packing its share pays no torch import (a second of CPU: most of `pack --rank 1` at K2.5's topology)."""
    code = f"""
import contextlib, io, json, sys
import cli.main
codes = []
for op in ("pack", "unpack"):
    with contextlib.redirect_stdout(io.StringIO()):
        codes.append(cli.main.main([op, {str(tp2)!r}, "--rank", "1"]))
print(json.dumps({{"codes": codes, "torch": "torch" in sys.modules}}))
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[-1]) == {"codes": [0, 0], "torch": False}


def test_a_second_pack_of_the_same_directory_is_refused_while_the_first_runs(tp2):
    """Two shells packing the same rank at once would convert the same files side by side and rewrite kconvert.json
    under each other: the second is refused in one line, and nothing is touched; once the first ends, it runs."""
    holder = subprocess.Popen(  # another kconvert's hold on the directory, as pack takes it
        [sys.executable, "-c", "import sys; from kconvert.io.dir_lock import held\n"
         f"with held(__import__('pathlib').Path({str(tp2)!r}), 'busy'):\n print('held', flush=True); sys.stdin.read()"],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        before = _snapshot(tp2)
        for args in (["pack", tp2, "--rank", "1"], ["unpack", tp2]):
            assert_one_line_error(cli_here(*args), "another `kconvert pack` or `unpack` is converting", str(tp2))
        assert _snapshot(tp2) == before
    finally:
        holder.communicate("")
    assert holder.returncode == 0
    assert cli_here("pack", tp2, "--rank", "1").returncode == 0
