"""Issue 42, class 3: `pack` / `unpack` over a directory with one damaged shard. It used to stop half-way and
leave the directory mid-pack: the rerun failed again and `unpack`, `verify-files` and `load` refused with
"unfinished pack ... re-run kconvert pack", a dead end. Now the damaged file is left as it was, the others
are finished and recorded, the one line names the file and the ways out (restore and re-run, or the opposite
command to roll back), and every read that does not touch the damaged file works meanwhile."""

from __future__ import annotations

import json
import shutil

import pytest

from helpers import assert_one_line_error, cli_here

DAMAGED = "rank-001/layer-0001.safetensors"


@pytest.fixture
def tp2(conversion, tmp_path):
    out = tmp_path / "tp2"
    shutil.copytree(conversion("tiny-k25-dsv32", tp=2, quant="fp8"), out)
    return out


def _flip_last_byte(f) -> bytes:
    data = f.read_bytes()
    f.write_bytes(data[:-1] + bytes([data[-1] ^ 0x55]))
    return data


def _stored(out) -> dict[str, bool]:
    return {rel: bool(rec.get("stored")) for rel, rec in json.loads((out / "kconvert.json").read_text())["files"].items()}


def test_pack_over_a_damaged_shard_finishes_the_rest_and_can_roll_back(tp2):
    good = _flip_last_byte(tp2 / DAMAGED)
    p = cli_here("pack", tp2)
    assert_one_line_error(p, DAMAGED, "checksum mismatch", "left it as it was", f"kconvert unpack {tp2}")
    stored = _stored(tp2)
    assert not stored[DAMAGED] and all(v for rel, v in stored.items() if rel != DAMAGED)
    assert not (tp2 / ".kconvert").exists()  # nothing unfinished: every read works meanwhile
    assert cli_here("load", tp2, "--rank", "0", "--device", "cpu", "--verify").returncode == 0
    r = cli_here("verify-files", tp2)
    assert r.returncode in (1, 2) and DAMAGED in r.stderr and "unfinished" not in r.stderr, r.stderr
    assert_one_line_error(cli_here("pack", tp2), DAMAGED, "finished the other 0 files")  # fast, the same file
    assert cli_here("unpack", tp2).returncode == 0  # roll back: every file plain again
    assert not any(_stored(tp2).values())
    (tp2 / DAMAGED).write_bytes(good)  # repaired
    assert cli_here("pack", tp2).returncode == 0 and all(_stored(tp2).values())
    assert cli_here("verify-files", tp2).returncode == 0


def test_unpack_over_a_damaged_shard_finishes_the_rest(tp2):
    assert cli_here("pack", tp2).returncode == 0
    good = _flip_last_byte(tp2 / DAMAGED)
    assert_one_line_error(cli_here("unpack", tp2), DAMAGED, f"kconvert pack {tp2}")
    stored = _stored(tp2)
    assert stored[DAMAGED] and not any(v for rel, v in stored.items() if rel != DAMAGED)
    assert cli_here("load", tp2, "--rank", "0", "--device", "cpu", "--verify").returncode == 0
    (tp2 / DAMAGED).write_bytes(good)
    assert cli_here("unpack", tp2).returncode == 0 and cli_here("verify-files", tp2).returncode == 0


def test_a_missing_shard_is_named_and_the_rest_packed(tp2):
    (tp2 / DAMAGED).unlink()
    assert_one_line_error(cli_here("pack", tp2), DAMAGED, "missing")
    assert cli_here("load", tp2, "--rank", "0", "--device", "cpu").returncode == 0
