"""kconvert.json is owned by kconvert.disk_format.catalog: its digest refuses any edit, its schema is
checked on every open, and no file name in it (or a symlink) reaches outside the directory. Every
reader and writer (load, verify-files, pack/unpack, verify) goes through it: exit 2, one line naming
kconvert.json and the field, nothing outside OUT touched."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from helpers import assert_one_line_error, read_meta, rewrite_catalog, run_cli
from kconvert.disk_format.catalog import Catalog, digest_of
from kconvert.errors import CheckpointError


@pytest.fixture(scope="module")
def converted(conversion):
    return conversion("tiny-k25-dsv32", tp=2, quant="int8")


@pytest.fixture
def out(converted, tmp_path):
    dst = tmp_path / "conv"
    shutil.copytree(converted, dst)
    return dst


def _meta(out: Path) -> dict:
    return read_meta(out)


def _tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.is_symlink():
            h.update(str(p.relative_to(root)).encode() + p.read_bytes())
    return h.hexdigest()


def _all_refuse(out: Path, *needles: str) -> None:
    """Every reader and writer refuses, in the library (load, verify-files, pack, unpack) and once through
    the CLI (one line, exit 2)."""
    from kconvert.convert.pack import pack, unpack
    from kconvert.disk_format.integrity import verify_files
    from kconvert.load.loader import open_converted

    for name, call in (("load", lambda: list(open_converted(out).stream("cpu", verify=True))),
                       ("verify-files", lambda: verify_files(out)), ("pack", lambda: pack(out)),
                       ("unpack", lambda: unpack(out))):
        with pytest.raises(CheckpointError) as e:
            call()
        line = e.value.one_line()
        assert "kconvert.json" in line and all(n in line for n in needles), (name, line)
    assert_one_line_error(run_cli("load", out, "--verify"), "kconvert.json", *needles)


def test_written_catalog_reads_back_and_digest_covers_everything(out):
    cat = Catalog.read(out)
    assert cat.doc["digest"] == digest_of(cat.doc) and cat.doc["digest"].startswith("sha256:")
    assert cat.tp == 2 and cat.scheme == "int8" and set(cat.rank_files(1)) == {
        f"rank-001/{u}.safetensors" for u in cat.units}


@pytest.mark.parametrize("edit", [
    lambda m: m["config"]["text_config"].update(num_hidden_layers=2),
    lambda m: m["layout"].update(tp=1),
    lambda m: m["tensors"].pop(),
    lambda m: m["files"]["rank-000/globals.safetensors"].update(crc32="00000000"),
], ids=["config", "tp", "tensor-list", "file-crc"])
def test_any_edit_without_a_new_digest_is_refused(out, edit):
    meta = _meta(out)
    edit(meta)
    (out / "kconvert.json").write_text(json.dumps(meta))
    assert_one_line_error(run_cli("load", out, "--verify"), "kconvert.json", "digest")
    assert_one_line_error(run_cli("verify-files", out), "kconvert.json", "digest")


@pytest.mark.parametrize("edit,field", [
    (lambda m: m["layout"].update(tp=4), "layout.world_size"),  # world_size 2 is not tp x pp
    (lambda m: m["layout"].update(tp=4, world_size=4), "files"),  # ranks 2 and 3 have no files
    (lambda m: m["layout"].update(pp=2, world_size=4), "layout.stages"),  # pp 2 without stages
    (lambda m: m["layout"].update(pp=2, world_size=4, stages=[{"units": m["layout"]["units"]}] * 2),
     "layout.stages"),  # every layer on both stages
    (lambda m: m["layout"].update(tp=0), "layout.tp"),
    (lambda m: m["layout"].update(tp="2"), "layout.tp"),
    (lambda m: (m.pop("tensors"), m.pop("tensors_by_rank")), "tensors_by_rank"),
    (lambda m: m["quantization"].update(scheme="fp3"), "quantization.scheme"),
    (lambda m: m["files"]["rank-001/globals.safetensors"].update(rank=0), "files['rank-001/globals.safetensors']"),
    (lambda m: m["tensors"][0].update(shape="big"), "tensors[0].shape"),
    (lambda m: m["tensors"][0].update(unit="layer-0099"), "tensors[0].unit"),
], ids=["tp-4", "tp-4-world-4", "pp-2", "pp-2-overlap", "tp-0", "tp-str", "no-tensors", "scheme", "rank-swap", "shape-type", "tensor-file"])
def test_schema_is_checked_even_with_a_valid_digest(out, edit, field):
    meta = _meta(out)
    edit(meta)
    rewrite_catalog(out, meta)
    with pytest.raises(CheckpointError, match="field"):
        Catalog.read(out).tensors
    _all_refuse(out, field)


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/passwd", "rank-000/../../x.safetensors", "",
                                  "rank-000//globals.safetensors"])
def test_file_names_leaving_the_directory_are_refused_everywhere(out, tmp_path, name):
    meta = _meta(out)
    meta["files"][name] = meta["files"].pop("rank-000/globals.safetensors")
    for t in meta["tensors"]:
        if t["file"] == "rank-000/globals.safetensors":
            t["file"] = name
    rewrite_catalog(out, meta)
    victim = tmp_path / "outside.safetensors"
    victim.write_bytes(b"do not touch")
    before = _tree_digest(tmp_path)
    _all_refuse(out)
    assert victim.read_bytes() == b"do not touch"
    assert _tree_digest(tmp_path) == before  # pack/unpack wrote nothing, inside or out


def test_a_shard_that_is_a_symlink_leading_out_is_refused(out, tmp_path):
    rel = "rank-001/layer-0000.safetensors"
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(out / rel, outside)
    os.symlink(outside, out / rel)
    before = outside.read_bytes()
    _all_refuse(out, "symlink")
    assert outside.read_bytes() == before


def test_older_format_versions_say_convert_again(out):
    meta = _meta(out)
    meta["format_version"] = 1
    meta.pop("digest")
    (out / "kconvert.json").write_text(json.dumps(meta))
    assert_one_line_error(run_cli("load", out), "kconvert.json", "format version 1", "convert again")


def test_version_2_directories_still_read_as_one_stage(out):
    """Format 3 added pipeline stages; a version-2 conversion (no pp, no stages) loads as pp = 1."""
    meta = _meta(out)
    meta["format_version"] = 2
    rewrite_catalog(out, meta)
    cat = Catalog.read(out)
    assert (cat.pp, cat.world_size, cat.stage_of(1), cat.tp_rank_of(1)) == (1, cat.tp, 0, 1)
    assert cat.stage_units(0) == cat.units
    assert run_cli("load", out).returncode == 0


def test_nan_in_kconvert_json_is_refused(out):
    text = (out / "kconvert.json").read_text().replace('"ep": 2', '"ep": NaN', 1)
    (out / "kconvert.json").write_text(text)
    assert_one_line_error(run_cli("verify-files", out), "kconvert.json", "not valid JSON")


def test_shard_refuses_side_files_that_are_symlinks_out_of_the_source(checkpoint, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(checkpoint("tiny-k25-dsv32"), src)
    secret = tmp_path / "secret.txt"
    secret.write_text("private")
    (src / "tokenizer_config.json").unlink()
    os.symlink(secret, src / "tokenizer_config.json")
    proc = run_cli("shard", src, tmp_path / "out", "--tp", "1")
    assert_one_line_error(proc, "tokenizer_config.json", "symlink")
    assert not (tmp_path / "out" / "kconvert.json").exists()
    assert not (tmp_path / "out" / "tokenizer_config.json").exists()


@pytest.mark.parametrize("edit,field", [
    (lambda t: t.update(crc32="zzzzzzzz"), "crc32"),
    (lambda t: t.update(name=7), "name"),
    (lambda t: t.update(rank=1 - t["rank"]), "differ from its file's"),
    (lambda t: t.update(shape=[True] * len(t["shape"])), "shape"),
])
def test_a_record_like_one_checked_already_is_still_checked(out, edit, field):
    """Writing kconvert.json checks 100k+ records; one like a record checked already (dtype, shape, slice) passes
    at once, so damage in any other field of a later record must still be named, with its index."""
    meta = _meta(out)
    keys = [(t["dtype"], t["shape"], t["slice"]) for t in meta["tensors"]]
    i = max(j for j, k in enumerate(keys) if k in keys[:j])  # the last record like an earlier one
    edit(meta["tensors"][i])
    with pytest.raises(CheckpointError, match=rf"field tensors\[{i}\].*{field}"):
        Catalog(meta).validate(out)


def test_rank_lists_are_the_bytes_json_dumps_writes(tmp_path):
    """The per-rank lists are encoded fast where that gives json.dumps' exact bytes (kconvert.json's digest and
    every conversion's bytes depend on them), and by json.dumps otherwise."""
    from kconvert.disk_format.rank_tensors import COLUMNS, FORMAT, list_file, write_lists

    base = {"name": "m.w", "unit": "layer-0001", "group": "text", "component": "experts", "expert": 3, "rule": "x",
            "slice": [0, 1, 2], "transform": "fp8", "dtype": "F8_E4M3", "shape": [2, 3], "crc32": "0011aabb", "rank": 0}
    for name in ["plain", "é", "a\x7fb", "ctl\x01\n", "\u2028", 'q"\\/']:
        for expert in (None, 3, 2**70):
            recs = [dict(base, name=name, expert=expert), base]
            want = json.dumps({"format": FORMAT, "rank": 0, "columns": list(COLUMNS),
                               "tensors": [[t[c] for c in COLUMNS] for t in recs]}, separators=(",", ":")).encode()
            (tmp_path / "rank-000").mkdir(exist_ok=True)
            index = write_lists(tmp_path, recs, 1)
            assert (tmp_path / list_file(0)).read_bytes() == want
            assert index == [{"file": list_file(0), "tensors": 2, "sha256": hashlib.sha256(want).hexdigest()}]


def test_verify_files_of_one_rank_reads_only_its_share(out):
    """`verify-files --rank R` checks rank R's files against its own tensor list and reads no other rank's: with rank
    1's list and one of its files damaged, rank 0 passes, rank 1 and the whole directory are refused naming what is
    wrong; a rank the conversion does not have is a usage error naming kconvert.json."""
    from kconvert.disk_format.integrity import verify_files

    cat = Catalog.read(out)
    whole = verify_files(out)
    mine = [verify_files(out, ranks=[r]) for r in (0, 1)]
    assert [m["files"] for m in mine] == [len(cat.rank_files(r)) for r in (0, 1)]
    assert sum(m["files"] for m in mine) == whole["files"] and sum(m["bytes"] for m in mine) == whole["bytes"]
    shard = out / sorted(cat.rank_files(1))[-1]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert verify_files(out, ranks=[0])["files"] == mine[0]["files"]
    with pytest.raises(CheckpointError, match="checksum mismatch") as e:
        verify_files(out, ranks=[1])
    assert e.value.file == str(shard)
    (out / "rank-001" / "tensors.json").write_text("{}")
    assert verify_files(out, ranks=[0])["files"] == mine[0]["files"]  # rank 1's list is not read
    with pytest.raises(CheckpointError, match="rank 1's tensor list was changed"):
        verify_files(out)
    assert_one_line_error(run_cli("verify-files", out, "--rank", "2"), "kconvert.json", "--rank 2", "ranks 0..1")
