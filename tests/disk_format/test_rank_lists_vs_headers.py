"""Issue 42, class 8: a rank's tensor list rewritten together with its digests (a tool that knows the format, or a
careful attacker) so that its rows no longer describe the shard: a dtype or shape that disagrees, a row missing,
duplicated or extra. `load` refused some of these; `verify-files`, `inspect`, `pack` and `unpack` accepted them
(verify-files said "all checksums match"). Every reader now checks the rows against the shard's header
(kconvert/disk_format/integrity.py check_listed)."""

from __future__ import annotations

import copy
import shutil

import pytest

from helpers import assert_one_line_error, cli_here, read_meta, rewrite_catalog

FILE = "rank-001/layer-0001.safetensors"


@pytest.fixture(scope="module")
def pristine(conversion):
    return conversion("tiny-k25-dsv32", tp=2, quant="fp8")


def _mine(meta: dict) -> list[int]:
    return [i for i, t in enumerate(meta["tensors"]) if t["file"] == FILE]


def _dtype(meta):
    meta["tensors"][_mine(meta)[0]]["dtype"] = "F32" if meta["tensors"][_mine(meta)[0]]["dtype"] != "F32" else "BF16"
    return meta["tensors"][_mine(meta)[0]]["name"]


def _shape(meta):
    t = meta["tensors"][_mine(meta)[0]]
    t["shape"] = [t["shape"][0] + 1, *t["shape"][1:]]
    return t["name"]


def _missing(meta):
    return meta["tensors"].pop(_mine(meta)[0])["name"]


def _duplicated(meta):
    t = meta["tensors"][_mine(meta)[0]]
    meta["tensors"].insert(_mine(meta)[0] + 1, copy.deepcopy(t))
    return t["name"]


def _extra(meta):
    t = copy.deepcopy(meta["tensors"][_mine(meta)[0]])
    t["name"] = "model.layers.1.not_in_the_shard.weight"
    meta["tensors"].insert(_mine(meta)[0], t)
    return t["name"]


EDITS = {"dtype": (_dtype, "kconvert.json says"), "shape": (_shape, "kconvert.json says"),
         "row missing": (_missing, "not in its rank's tensor list"),
         "row duplicated": (_duplicated, "listed twice"),
         "row extra": (_extra, "missing from the shard")}


@pytest.fixture(scope="module")
def packed(pristine, tmp_path_factory):
    out = tmp_path_factory.mktemp("packed") / "tp2"
    shutil.copytree(pristine, out)
    assert cli_here("pack", out).returncode == 0
    return out


@pytest.mark.parametrize("edit", list(EDITS))
def test_rows_that_do_not_describe_the_shard_are_one_line(pristine, packed, tmp_path, edit):
    change, needle = EDITS[edit]
    for form, source, commands in (("plain", pristine, ("verify-files", "inspect", "load", "pack")),
                                   ("packed", packed, ("unpack",))):
        out = tmp_path / form
        shutil.copytree(source, out)
        meta = read_meta(out)
        name = change(meta)
        rewrite_catalog(out, meta)
        for command in commands:
            args = (command, out, "--rank", "1", "--device", "cpu") if command == "load" else (command, out)
            assert_one_line_error(cli_here(*args), FILE, f"tensor {name}", needle)


@pytest.mark.parametrize("body, needle", [("[" * 100_000 + "]" * 100_000, "nested too deep"),
                                          ("9" * 6000, "not valid JSON")], ids=["nested 100k deep", "6000 digits"])
def test_a_rank_list_past_the_json_decoder_is_one_line(pristine, tmp_path, body, needle):
    """Class 7: a rank list nested 100k deep or holding a 6000-digit number, behind rewritten digests, ended in
    RecursionError / ValueError (exit 3)."""
    import hashlib

    out = tmp_path / "tp2"
    shutil.copytree(pristine, out)
    meta = read_meta(out)
    meta.pop("tensors")
    raw = ('{"format": "kconvert-rank-tensors", "rank": 1, "tensors": ' + body + "}").encode()
    (out / "rank-001" / "tensors.json").write_bytes(raw)
    meta["tensors_by_rank"][1]["sha256"] = hashlib.sha256(raw).hexdigest()
    rewrite_catalog(out, meta)
    for args in (("verify-files", out), ("inspect", out), ("load", out, "--rank", "1", "--device", "cpu")):
        assert_one_line_error(cli_here(*args), "rank-001/tensors.json", needle)
