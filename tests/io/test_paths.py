"""kconvert/io/paths.contained: a path a checkpoint names stays inside its directory, whether its parts are plain
(answered by one lstat a part) or symlinks (answered by realpath): a link out is refused, a link within accepted."""

from __future__ import annotations

import os

import pytest

from kconvert.errors import CheckpointError
from kconvert.io.paths import contained, contained_all


@pytest.fixture
def tree(tmp_path):
    root, outside = tmp_path / "conv", tmp_path / "elsewhere"
    (root / "rank-000").mkdir(parents=True)
    outside.mkdir()
    (root / "rank-000" / "a.safetensors").write_bytes(b"x")
    (outside / "b.safetensors").write_bytes(b"y")
    os.symlink(outside / "b.safetensors", root / "rank-000" / "out.safetensors")  # a file linking out
    os.symlink(outside, root / "rank-001")  # a folder linking out
    os.symlink(root / "rank-000" / "a.safetensors", root / "rank-000" / "in.safetensors")  # a link within
    os.symlink(root / "rank-000", root / "rank-002")  # a folder link within
    return root


@pytest.mark.parametrize("rel", ["rank-000/a.safetensors", "rank-000/in.safetensors", "rank-002/a.safetensors",
                                 "rank-000/missing.safetensors"])
def test_inside(tree, rel):
    assert contained(tree, rel, named_in=tree / "kconvert.json") == tree / rel


@pytest.mark.parametrize("rel", ["rank-000/out.safetensors", "rank-001/b.safetensors", "rank-001/missing"])
def test_a_link_out_is_refused(tree, rel):
    with pytest.raises(CheckpointError, match="symlink leading out"):
        contained(tree, rel, named_in=tree / "kconvert.json")


def test_a_root_reached_through_a_link_is_its_target(tree, tmp_path):
    os.symlink(tree, tmp_path / "via")
    assert contained(tmp_path / "via", "rank-000/a.safetensors", named_in="k") == tmp_path / "via/rank-000/a.safetensors"
    with pytest.raises(CheckpointError):
        contained(tmp_path / "via", "rank-001/b.safetensors", named_in="k")


@pytest.mark.parametrize("rel", ["rank-000/a.safetensors", "rank-000/in.safetensors", "rank-002/a.safetensors",
                                 "rank-000/missing.safetensors", "rank-009/missing.safetensors"])
def test_many_names_at_once_inside(tree, rel):
    contained_all(tree, ["rank-000/a.safetensors", rel], named_in=tree / "kconvert.json")


@pytest.mark.parametrize("rel", ["rank-000/out.safetensors", "rank-001/b.safetensors", "rank-001/missing",
                                 "../x.safetensors", "/abs.safetensors"])
def test_many_names_at_once_refuse_what_one_refuses(tree, rel):
    with pytest.raises(CheckpointError) as one:
        contained(tree, rel, named_in=tree / "kconvert.json")
    with pytest.raises(CheckpointError) as many:
        contained_all(tree, ["rank-000/a.safetensors", rel], named_in=tree / "kconvert.json")
    assert str(many.value) == str(one.value)
