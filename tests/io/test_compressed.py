"""Compressed shards (issue 7): `shard --compress`, `pack` / `unpack` in place (byte-identical round trip,
resumable), headers and random access without decompressing everything, the loader reading both
forms, and the bad inputs: corrupt chunk, truncated chunk index, plain checksum failure, unknown codec."""

from __future__ import annotations

import filecmp
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import assert_one_line_error, cli_here, run_cli, rewrite_catalog
from kconvert.io import compressed as comp_mod
from kconvert.io.compress_file import compress_file
from kconvert.io.compressed import parse_codec
from kconvert.disk_format.integrity import verify_files
from kconvert.errors import CheckpointError, KConvertError, UsageError
from kconvert.load.loader import open_converted
from kconvert.convert.pack import pack, unpack
from kconvert.io.safetensors_read import read_header, read_tensor
from helpers import shard_job
from kconvert.convert.shard.job import shard

CASES = {"none": ("tiny-k25-dsv32", 2), "fp8": ("tiny-k25-dsv32-fp8", 1), "int8": ("tiny-k25-dsv32", 1)}


@pytest.fixture(scope="module")
def convs(checkpoint, tmp_path_factory):
    """quant -> (plain dir, dir written by shard --compress) of the same job."""
    base = tmp_path_factory.mktemp("zconv")
    out = {}
    for quant, (preset, tp) in CASES.items():
        src = str(checkpoint(preset))
        plain = shard(shard_job(src, base / f"{quant}-plain", tp=tp, quant=quant)).out
        z = shard(shard_job(src, base / f"{quant}-z", tp=tp, quant=quant, compress="zstd")).out
        out[quant] = Path(plain), Path(z)
    return out


def same_tree(a: Path, b: Path) -> None:
    fa = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    fb = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    assert fa == fb
    for rel in fa:
        assert filecmp.cmp(a / rel, b / rel, shallow=False), rel


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("quant", list(CASES))
def test_shard_compress_loads_the_same_tensors_and_unpacks_to_the_plain_conversion(convs, quant, tmp_path):
    plain, z = convs[quant]
    mp, mz = json.loads((plain / "kconvert.json").read_text()), json.loads((z / "kconvert.json").read_text())
    stored = sum(r["stored"]["bytes"] for r in mz["files"].values())
    assert stored == sum((z / f).stat().st_size for f in mz["files"]) < sum(r["bytes"] for r in mp["files"].values())
    for r in mz["files"].values():
        assert r.pop("stored")["codec"] == "zstd"
    assert mz.pop("digest") != mp.pop("digest")  # the digest covers the storage form too
    assert mz == mp  # same sizes and CRC-32s of the plain bytes: verify means the same for both forms
    assert verify_files(z)["files"] == len(mp["files"])
    for rank in range(mp["layout"]["tp"]):
        cp, cz = open_converted(plain, rank), open_converted(z, rank)
        for (u1, t1), (u2, t2) in zip(cp.stream("cpu", verify=True), cz.stream("cpu", verify=True, threads=3)):
            assert u1 == u2 and set(t1) == set(t2)
            for name in t1:
                assert t1[name].dtype == t2[name].dtype and torch.equal(as_bytes(t1[name]), as_bytes(t2[name])), name
    copy = tmp_path / "z"
    shutil.copytree(z, copy)
    r = unpack(copy)
    assert r.details.files == len(mp["files"])
    same_tree(plain, copy)  # kconvert.json included, byte for byte


def test_pack_unpack_in_place_is_byte_identical(convs, tmp_path):
    plain = convs["none"][0]
    out = tmp_path / "c"
    shutil.copytree(plain, out)
    r = json.loads(run_cli("pack", out, "--compress", "zstd:3", "--json", check=True).stdout)
    assert r["files"] == 10 and r["stored_bytes"] < r["plain_bytes"]
    assert not (out / ".kconvert").exists()
    meta = json.loads((out / "kconvert.json").read_text())
    assert all(rec["stored"]["level"] == 3 for rec in meta["files"].values())
    verify_files(out)
    again = pack(out)
    assert again.details.files == 0 and again.details.untouched == 10
    for f in meta["files"]:  # a plain safetensors reader refuses a compressed shard rather than misreading it
        with pytest.raises(Exception):
            load_file(out / f)
        break
    run_cli("unpack", out, check=True)
    same_tree(plain, out)


def test_pack_resumes_and_the_loader_refuses_a_half_packed_directory(convs, tmp_path):
    plain = convs["none"][0]
    out = tmp_path / "c"
    shutil.copytree(plain, out)
    meta = json.loads((out / "kconvert.json").read_text())
    files = list(meta["files"])

    def die_after_two(event, **kw):
        if event == "file" and kw["path"] == files[1]:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        pack(out, progress=die_after_two)
    # a run killed after its rename but before its journal line: the file is compressed, not journalled
    compress_file(out / files[2], out / files[2])
    assert_one_line_error(run_cli("load", out), "unfinished `kconvert pack`")
    assert "unfinished `kconvert pack`" in one_line(lambda: unpack(out))
    r = pack(out)
    assert r.details.resumed == 2 and r.details.files == len(files) - 2
    verify_files(out)
    unpack(out)
    same_tree(plain, out)


def test_header_readable_and_one_tensor_or_rows_read_alone(convs, tmp_path, monkeypatch):
    plain = convs["none"][0]
    src = plain / "rank-000" / "layer-0001.safetensors"
    dst = tmp_path / "l1.safetensors"
    compress_file(src, dst, chunk=8192)  # small chunks: big tensors span many
    hp, hz = read_header(src), read_header(dst)
    assert hz.compressed is not None and hp.compressed is None
    assert hz.size == hp.size and hz.stored_size == dst.stat().st_size < hp.size
    assert hz.data_start == hp.data_start and hz.metadata["kconvert_codec"] == "zstd"
    assert {n: (e.dtype, e.shape, e.begin, e.end) for n, e in hz.tensors.items()} == \
           {n: (e.dtype, e.shape, e.begin, e.end) for n, e in hp.tensors.items()}
    layout = hz.compressed
    big = max(hz.tensors.values(), key=lambda e: e.nbytes)
    assert big.dtype == "BF16" and big.nbytes > 4 * 8192
    groups = {layout.group[i] for i in range(layout.n_chunks) if big.begin <= layout.u_off[i] < big.end}
    assert groups == {2}  # bf16: high and low bytes apart
    decoded = []
    real = comp_mod.ChunkIndex._decode
    monkeypatch.setattr(comp_mod.ChunkIndex, "_decode",
                        lambda self, i, fd, out: (decoded.append(i), real(self, i, fd, out)))
    rows = (3, 7)
    got = read_tensor(big, rows=rows)
    assert torch.equal(got, read_tensor(hp.tensors[big.name], rows=rows))
    assert 1 <= len(decoded) <= 2  # only the chunks those rows live in
    for name, e in hz.tensors.items():
        assert torch.equal(as_bytes(read_tensor(e)), as_bytes(read_tensor(hp.tensors[name]))), name


def test_one_byte_and_scale_tensors(convs):
    z = convs["fp8"][1]
    h = read_header(z / "rank-000" / "layer-0001.safetensors")
    lay = h.compressed
    fp8 = [e for e in h.tensors.values() if e.dtype == "F8_E4M3"]
    assert fp8
    for e in fp8:  # fp8 stays as stored: nibble grouping measured worse (bench/compress_bench.py)
        assert all(lay.group[i] == 1 for i in range(lay.n_chunks) if e.begin <= lay.u_off[i] < e.end)


def test_compressed_source_checkpoint_inspects_and_converts(checkpoint, copy_checkpoint, convs, tmp_path):
    src = copy_checkpoint(checkpoint("tiny-k25-dsv32"))
    for f in sorted(src.glob("*.safetensors")):
        compress_file(f, f)
    summary = json.loads(run_cli("inspect", src, "--json", check=True).stdout)
    assert summary["tensors"] > 0
    out = Path(shard(shard_job(src, tmp_path / "o", tp=1, quant="int8")).out)
    want = json.loads((convs["int8"][0] / "kconvert.json").read_text())["files"]
    got = json.loads((out / "kconvert.json").read_text())["files"]
    assert got == want  # same bytes written from a compressed source


def test_codec_arguments():
    assert parse_codec("zstd") == ("zstd", comp_mod.DEFAULT_LEVEL) and parse_codec("zstd:9") == ("zstd", 9)
    for bad in ("lz4", "zstd:x", "zstd:99"):
        with pytest.raises(UsageError):
            parse_codec(bad)


def test_bad_codec_argument_cli(checkpoint, tmp_path):
    assert_one_line_error(run_cli("shard", checkpoint("tiny-k25-dsv32"), tmp_path / "o", "--tp", 1, "--compress", "lz4"),
                          "unknown codec 'lz4'")


# ------------------------------------------------------------------ bad input


def one_line(fn) -> str:
    """The one-line message the CLI would print for fn's error (the CLI path is run once per test)."""
    with pytest.raises(KConvertError) as e:
        fn()
    return e.value.one_line()


def load_all(out: Path, verify: bool = False) -> None:
    for _ in open_converted(out).stream("cpu", verify=verify):
        pass


def _copy_z(convs, tmp_path) -> Path:
    dst = tmp_path / "z"
    shutil.copytree(convs["none"][1], dst)
    return dst


def _restat(out: Path, rel: str) -> None:
    """Make kconvert.json agree with the file's new size (a consistent-looking but damaged shard)."""
    meta = json.loads((out / "kconvert.json").read_text())
    meta["files"][rel]["stored"]["bytes"] = (out / rel).stat().st_size
    rewrite_catalog(out, meta)


REL = "rank-000/layer-0001.safetensors"


def test_corrupt_chunk(convs, tmp_path):
    out = _copy_z(convs, tmp_path)
    lay = read_header(out / REL).compressed
    i = max(range(lay.n_chunks), key=lambda i: lay.c_len[i])
    data = bytearray((out / REL).read_bytes())
    data[lay.c_off[i] + lay.c_len[i] // 2] ^= 0x5A
    (out / REL).write_bytes(bytes(data))
    tensor = lay.owner(lay.u_off[i])
    assert tensor.startswith("language_model.")
    assert_one_line_error(run_cli("load", out), REL, f"tensor {tensor}", f"chunk {i} is damaged")
    for fn in (lambda: load_all(out, verify=True), lambda: verify_files(out), lambda: unpack(out)):
        msg = one_line(fn)
        assert REL in msg and f"tensor {tensor}" in msg and f"chunk {i} is damaged" in msg, msg


def test_truncated_chunk_index(convs, tmp_path):
    out = _copy_z(convs, tmp_path)
    compress_file(convs["none"][0] / REL, out / REL, chunk=4096)  # small chunks: an index of more than 3 entries
    _restat(out, REL)
    lay = read_header(out / REL).compressed
    assert lay.n_chunks > 4
    cut = lay.index_at + 3 * comp_mod.ENTRY.size + 5  # three whole entries survive
    (out / REL).write_bytes((out / REL).read_bytes()[:cut])
    assert "truncated" in one_line(lambda: load_all(out))  # size differs from kconvert.json
    _restat(out, REL)
    proc = run_cli("load", out)
    assert_one_line_error(proc, REL, "chunk index truncated", "3 of", "tensor ")
    with pytest.raises(KConvertError) as e:
        read_header(out / REL)
    assert e.value.tensor == lay.owner(lay.u_off[3]) and e.value.file.endswith(REL)


def test_compressed_file_whose_plain_checksum_fails(convs, tmp_path):
    out = _copy_z(convs, tmp_path)
    plain = convs["none"][0] / REL
    h = read_header(plain)
    victim = max(h.tensors.values(), key=lambda e: e.nbytes)
    data = bytearray(plain.read_bytes())
    data[victim.begin + 10] ^= 0x01
    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes(bytes(data))
    compress_file(damaged, out / REL)  # decompresses fine, to the wrong bytes
    _restat(out, REL)
    load_all(out)  # without verify nothing looks wrong
    assert_one_line_error(run_cli("load", out, "--verify"), REL, "checksum mismatch", f"tensor {victim.name}")
    for fn in (lambda: verify_files(out), lambda: unpack(out)):
        msg = one_line(fn)
        assert REL in msg and "checksum mismatch" in msg and f"tensor {victim.name}" in msg, msg
    with pytest.raises(CheckpointError):
        verify_files(out)


def test_unknown_codec(convs, tmp_path):
    out = _copy_z(convs, tmp_path)
    raw = (out / REL).read_bytes()
    assert raw.count(b'"kconvert_codec":"zstd"') == 1
    (out / REL).write_bytes(raw.replace(b'"kconvert_codec":"zstd"', b'"kconvert_codec":"lz9x"'))
    assert_one_line_error(run_cli("load", out), REL, "unknown codec 'lz9x'", "tensor ")
    for fn in (lambda: verify_files(out), lambda: unpack(out)):
        msg = one_line(fn)
        assert REL in msg and "unknown codec 'lz9x'" in msg and "tensor " in msg, msg


def test_inspect_reads_converted_directories(convs):
    """`kconvert inspect OUT` of a converted directory, plain and compressed: family, tp x pp, ranks, scheme,
    bytes on disk per rank (what each rank's files take) and compressed or not."""
    for out, compressed in zip(convs["none"], ("no", "yes")):
        r = cli_here("inspect", out, "--json")
        assert r.returncode == 0, r.stderr
        got = json.loads(r.stdout)
        assert (got["kind"], got["family"], got["tp"], got["pp"], got["ranks"]) == ("converted", "kimi_k25", 2, 1, 2)
        assert got["scheme"] == "none" and got["compressed"] == compressed
        on_disk = {r: sum(f.stat().st_size for f in (out / f"rank-{r:03d}").glob("*.safetensors")) for r in (0, 1)}
        assert {int(k): v for k, v in got["bytes_per_rank"].items()} == on_disk
        assert "2 ranks" in " ".join(cli_here("inspect", out).stdout.split())  # (rich wraps a long path's line)
