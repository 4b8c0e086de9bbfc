"""Fault injection on converted directories (issue 10, item 7): a seeded campaign of damaged shards
(any byte, truncation, trailing bytes, swapped or missing files), of damaged rank lists (issue 42: bytes, a
FIFO, rows that disagree with the shards behind rewritten digests) and damaged kconvert.json files;
every one must fail `verify-files` cleanly (one line, exit 1 or 2) and change nothing."""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path

import pytest

from faults import CLI_EVERY, MANIFEST, SEED, convert, refused, snapshot
from helpers import cli_here, run_cli
from kconvert.disk_format.integrity import verify_files

N_CONVERTED = 90


@pytest.fixture(scope="module")
def converted(checkpoint, tmp_path_factory):
    """Two finished conversions of tiny-k25-dsv32 (tp 2 fp8: plain shards; tp 2 none: zstd-compressed shards)."""
    root = tmp_path_factory.mktemp("converted")
    outs = []
    for name, kw in (("fp8", {"quant": "fp8"}), ("zstd", {"quant": "none", "compress": "zstd:3"})):
        out = root / name
        assert convert(checkpoint("tiny-k25-dsv32"), out, **kw) is None
        outs.append(out)
    return root, outs


def _damage_converted(rng: random.Random, out: Path, files: list[str]) -> tuple[str, dict[str, bytes]]:
    """Damage one or two files of `out`; return what was done and the original bytes to restore."""
    rel = rng.choice(files)
    f = out / rel
    data = bytearray(f.read_bytes())
    saved = {rel: bytes(data)}
    kind = rng.choice(["byte", "byte", "byte", "header_byte", "length", "truncate", "append", "swap", "missing"])
    if kind in ("byte", "header_byte"):
        (n,) = struct.unpack("<Q", data[:8])
        pos = rng.randrange(8, 8 + n) if kind == "header_byte" else rng.randrange(len(data))
        data[pos] ^= 1 << rng.randrange(8) if rng.random() < 0.5 else rng.randrange(1, 256)
        what = f"byte {pos}"
    elif kind == "length":
        data[:8] = struct.pack("<Q", rng.choice([0, 7, len(data), 2**64 - 1]))
        what = "length prefix"
    elif kind == "truncate":
        del data[rng.randrange(len(data)):]
        what = "truncated"
    elif kind == "append":
        data += b"\0" * rng.randrange(1, 100)
        what = "trailing bytes"
    elif kind == "swap":
        other = rng.choice([x for x in files if x != rel])
        saved[other] = (out / other).read_bytes()
        data = bytearray(saved[other])
        (out / other).write_bytes(saved[rel])
        what = f"swapped with {other}"
    else:
        f.unlink()
        return f"{rel}: deleted", saved
    f.write_bytes(bytes(data))
    return f"{rel}: {kind} {what}", saved


def test_campaign_converted_shards(converted):
    root, outs = converted
    rng = random.Random(SEED + 1)
    for case in range(N_CONVERTED):
        out = outs[case % len(outs)]
        files = sorted(json.loads((out / MANIFEST).read_text())["files"])
        what, saved = _damage_converted(rng, out, files)
        try:
            before = snapshot(root)
            if case % CLI_EVERY == 1:
                r = (run_cli if case == 1 else cli_here)("verify-files", out)
                assert r.returncode in (1, 2) and len(r.stderr.strip().splitlines()) == 1, (what, r.stderr)
                assert "Traceback" not in r.stderr
            err = refused(lambda: verify_files(out))
            assert err is not None, f"case {case}, {what}: verify-files passed"
            assert snapshot(root) == before, f"{what}: verify changed a file"
        finally:
            for rel, data in saved.items():
                (out / rel).write_bytes(data)
    for out in outs:
        verify_files(out)  # restored: intact again


# ------------------------------------------------------------------- rank lists (issue 42, the newest surface)

N_RANK_LISTS = 40


def _damage_rank_list(rng: random.Random, out: Path) -> tuple[str, dict[str, bytes]]:
    """Damage a rank's tensors.json: its bytes (its sha256 then disagrees), or its rows with every digest
    rewritten to match (then only the shards' headers can tell: integrity.check_listed), or a FIFO in its place
    (the one reader refuses it rather than block). Returns what was done and the bytes to restore."""
    import copy
    import os

    from helpers import read_meta, rewrite_catalog

    rank = rng.randrange(2)
    rel = f"rank-{rank:03d}/tensors.json"
    saved = {rel: (out / rel).read_bytes(), MANIFEST: (out / MANIFEST).read_bytes()}
    kind = rng.choice(["byte", "truncate", "fifo", "dtype", "shape", "drop", "duplicate", "extra"])
    if kind in ("byte", "truncate"):
        data = bytearray(saved[rel])
        pos = rng.randrange(len(data))
        if kind == "byte":
            data[pos] ^= rng.randrange(1, 256)
        else:
            del data[pos:]
        (out / rel).write_bytes(bytes(data))
        return f"{rel}: {kind} at {pos}", saved
    if kind == "fifo":
        (out / rel).unlink()
        os.mkfifo(out / rel)
        return f"{rel}: a FIFO", saved
    meta = read_meta(out)
    mine = [i for i, t in enumerate(meta["tensors"]) if t["rank"] == rank]
    i = rng.choice(mine)
    t = meta["tensors"][i]
    if kind == "dtype":
        t["dtype"] = "F32" if t["dtype"] != "F32" else "BF16"
    elif kind == "shape":
        t["shape"] = [*t["shape"][:-1], t["shape"][-1] + rng.randrange(1, 4)] if t["shape"] else [1]
    elif kind == "drop":
        meta["tensors"].pop(i)
    elif kind == "duplicate":
        meta["tensors"].insert(i, copy.deepcopy(t))
    else:
        meta["tensors"].insert(i, {**copy.deepcopy(t), "name": t["name"] + ".extra"})
    rewrite_catalog(out, meta)
    return f"{rel}: row {i} {kind}, digests rewritten", saved


def test_campaign_rank_lists(converted):
    """Every damaged rank list is refused by verify-files (and, one case in CLI_EVERY // 4, by inspect and load
    too) in one line, exit 2, and nothing changes (pack and unpack, which finish the other files by design:
    tests/disk_format/test_rank_lists_vs_headers.py)."""
    import os

    root, outs = converted
    rng = random.Random(SEED + 42)
    for case in range(N_RANK_LISTS):
        out = outs[case % len(outs)]
        what, saved = _damage_rank_list(rng, out)
        try:
            before = snapshot(root)
            assert refused(lambda: verify_files(out)) is not None, f"case {case}, {what}: verify-files passed"
            if case % (CLI_EVERY // 4) == 1:
                rank = what[len("rank-"):len("rank-000")]  # the damaged list's rank: load reads only its own
                for args in (("inspect", out), ("load", out, "--rank", str(int(rank)), "--device", "cpu")):
                    r = cli_here(*args)
                    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, (what, args[0], r.stderr)
            assert snapshot(root) == before, f"{what}: a reader changed a file"
        finally:
            for rel, data in saved.items():
                if (out / rel).is_fifo():
                    os.unlink(out / rel)
                (out / rel).write_bytes(data)
    for out in outs:
        verify_files(out)  # restored: intact again


# ------------------------------------------------------------------------------ kconvert.json itself

def _edit_tp(meta):
    meta["layout"]["tp"] = 3


def _edit_config(meta):
    meta["config"]["text_config"]["num_hidden_layers"] = 2


def _edit_path(meta):
    rel = next(iter(meta["files"]))
    meta["files"]["../" + rel] = meta["files"].pop(rel)


def _edit_tensor(meta):
    meta["tensors_by_rank"][0]["tensors"] = 1


def _drop_files(meta):
    del meta["files"]


@pytest.mark.parametrize("edit", [_edit_tp, _edit_config, _edit_path, _edit_tensor, _drop_files])
def test_damaged_kconvert_json_refused(converted, edit):
    root, outs = converted
    path = outs[0] / MANIFEST
    saved = path.read_bytes()
    meta = json.loads(saved)
    edit(meta)
    path.write_text(json.dumps(meta, indent=1))
    try:
        before = snapshot(root)
        err = refused(lambda: verify_files(outs[0]))
        assert snapshot(root) == before
        assert err is not None and MANIFEST in err.one_line()
    finally:
        path.write_bytes(saved)


# ------------------------------------------------------------------------------------------- disk full
