"""Fault injection (issue 10, item 7): damaged variants of the fixtures, built here, byte by byte.

For every case: a clean refusal (KConvertError with exit code 2 in-process; exit 2 with one line on
stderr and no traceback through the CLI) or, for converted shards, a failed check; nothing written
outside OUT; nothing outside OUT changed; no kconvert.json (the mark of a complete conversion) after
a failed conversion. The seeded campaign damages source shards (header bytes, length prefix,
truncation, trailing bytes, NaN/Inf in data, edited header fields) and converted shards (any byte,
truncation, trailing bytes, swapped or missing files). Source data bytes are not checksummed by
safetensors, so a damaged source header is judged against the safetensors library itself: a file
the library refuses must be refused; a file it reads may convert, and then kconvert must have read
exactly what the library reads. Most cases run in-process; a sample goes through the CLI's entry point
(exit code, one line on stderr), the first of each campaign as a separate `kconvert` process.
"""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import ROOT, assert_one_line_error, cli_here, header_offsets, run_cli
from kconvert.convert.shard import ShardJob, shard
from kconvert.converted.integrity import verify_files
from kconvert.errors import KConvertError, NonFiniteError
from kconvert.source.checkpoint import Checkpoint

SEED = 20261130
N_SOURCE = 130
N_CONVERTED = 90
CLI_EVERY = 40  # one case in this many also runs through `kconvert` (the first in a subprocess, the rest in-process)
MANIFEST = "kconvert.json"
FLOATS = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


# ------------------------------------------------------------------------------------------ helpers


def snapshot(root: Path, skip: Path | None = None) -> dict[str, tuple[int, int]]:
    """Every file under `root` (but `skip`) with its size and mtime: any write shows up."""
    out = {}
    for p in sorted(root.rglob("*")):
        if skip is not None and (p == skip or skip in p.parents):
            continue
        st = p.lstat()
        out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns) if p.is_file() else (-1, 0)
    return out


def refused(fn) -> KConvertError | None:
    """None when `fn()` succeeds; the error when it refuses as a user would be told (exit 2, one line).
    Any other exception (an exit-3 internal error for a user) propagates and fails the test."""
    try:
        fn()
        return None
    except KConvertError as e:
        assert e.exit_code == 2, e
        assert "\n" not in e.one_line()
        return e


def convert(src: Path, out: Path, **kw) -> KConvertError | None:
    job = ShardJob(str(src), str(out), kw.pop("tp", 2), quant=kw.pop("quant", "fp8"), **kw)
    return refused(lambda: shard(job))


def library_reads(f: Path) -> dict[str, torch.Tensor] | None:
    """Every tensor of `f` as the safetensors library reads it, or None when it refuses the file."""
    from safetensors import safe_open

    try:
        with safe_open(f, "pt") as g:
            return {k: g.get_tensor(k) for k in g.keys()}
    except Exception:  # the library's many error types: any refusal counts
        return None


def write_header(f: Path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def value_bytes(dtype: str, value: float) -> bytes:
    return torch.tensor([value]).to(FLOATS[dtype]).view(torch.uint8).numpy().tobytes()


class Sandbox:
    """ROOT/src (a private copy of a fixture) and ROOT/out; damage one file, run, check, restore."""

    def __init__(self, fixture: Path, root: Path):
        self.root = root
        self.src = root / "src"
        self.out = root / "out"
        shutil.copytree(fixture, self.src)
        self.pristine = {p.name: p.read_bytes() for p in self.src.iterdir() if p.is_file()}
        self.shards = sorted(n for n in self.pristine if n.endswith(".safetensors"))

    def restore(self) -> None:
        shutil.rmtree(self.out, ignore_errors=True)
        for p in self.src.iterdir():
            if p.name not in self.pristine:
                p.unlink()
        for name, data in self.pristine.items():
            if (self.src / name).read_bytes() != data:
                (self.src / name).write_bytes(data)

    def convert_checked(self, **kw) -> KConvertError | None:
        """Convert src -> out; assert nothing outside out changed and no complete-looking out on failure."""
        before = snapshot(self.root, skip=self.out)
        err = convert(self.src, self.out, **kw)
        assert snapshot(self.root, skip=self.out) == before, "a file outside OUT was written or changed"
        if err is not None:
            assert not (self.out / MANIFEST).exists(), "kconvert.json left after a failed conversion"
        return err


@pytest.fixture(scope="module")
def sandbox(checkpoint, tmp_path_factory):
    box = Sandbox(checkpoint("tiny-k3"), tmp_path_factory.mktemp("faults"))
    yield box
    box.restore()


# ------------------------------------------------------------------------------ each class of issue 10


@pytest.mark.parametrize("section,field,value", [
    ("text_config", "num_hidden_layers", 10**9),
    ("text_config", "n_routed_experts", 10**9),
    ("text_config", "hidden_size", "7168"),
    ("text_config", "vocab_size", [1] * 10000),
    ("vision_config", "merge_kernel_size", [2, "2"]),
])
def test_config_out_of_bounds_refused(sandbox, section, field, value):
    config = json.loads((sandbox.src / "config.json").read_text())
    config[section][field] = value
    (sandbox.src / "config.json").write_text(json.dumps(config))
    try:
        err = sandbox.convert_checked()
        assert err is not None and "config.json" in err.one_line() and f"{section}.{field}" in err.one_line()
    finally:
        sandbox.restore()


@pytest.mark.parametrize("block", [[0, 128], [128, -1], ["128", 128], [2**40, 128]])
def test_fp8_source_with_absurd_block_size_refused(checkpoint, tmp_path, block):
    box = Sandbox(checkpoint("tiny-k3-fp8"), tmp_path)
    config = json.loads((box.src / "config.json").read_text())
    qc = config.get("quantization_config") or config["text_config"]["quantization_config"]
    qc["weight_block_size"] = block
    (box.src / "config.json").write_text(json.dumps(config))
    err = box.convert_checked(requantize=True)
    assert err is not None and "weight_block_size" in err.one_line()


NON_FINITE = [  # (fixture, stored tensor, value, target): kept in bf16, in fp32, a scale, an fp8 weight, an INT4 scale
    ("tiny-k3", "language_model.model.layers.0.input_layernorm.weight", float("nan"), "none"),
    ("tiny-k3", "language_model.model.norm.weight", float("inf"), "fp8"),
    ("tiny-k3", "language_model.lm_head.weight", float("-inf"), "fp8"),
    ("tiny-k3", "language_model.model.layers.2.mlp.gate.e_score_correction_bias", float("nan"), "int8"),
    ("tiny-k3", "vision_tower.encoder.blocks.1.wqkv.bias", float("nan"), "fp8"),
    ("tiny-k3", "language_model.model.layers.1.mlp.experts.4.up_proj.weight", float("inf"), "fp8"),
    ("tiny-k3-fp8", "language_model.model.layers.1.self_attn.kv_b_proj.weight_scale_inv", float("nan"), "fp8"),
    ("tiny-k3-fp8", "language_model.model.layers.1.self_attn.kv_b_proj.weight_scale_inv", float("inf"), "none"),
    ("tiny-k3-fp8", "language_model.model.layers.2.mlp.experts.0.gate_proj.weight", "fp8-nan", "fp8"),
    ("tiny-k3-int4", "language_model.model.layers.2.mlp.experts.7.gate_proj.weight_scale", float("nan"), "fp8"),
]


@pytest.mark.parametrize("fixture,tensor,value,target", NON_FINITE)
def test_non_finite_source_refused_whatever_the_target(checkpoint, tmp_path, fixture, tensor, value, target):
    box = Sandbox(checkpoint(fixture), tmp_path)
    f = box.src / json.loads((box.src / "model.safetensors.index.json").read_text())["weight_map"][tensor]
    start, header = header_offsets(f)
    spec = header[tensor]
    raw = b"\x7f" if value == "fp8-nan" else value_bytes(spec["dtype"], value)
    data = bytearray(f.read_bytes())
    count = (spec["data_offsets"][1] - spec["data_offsets"][0]) // len(raw)
    at = start + spec["data_offsets"][0] + min(5, count - 1) * len(raw)  # the last element of a tiny scale grid
    data[at:at + len(raw)] = raw
    f.write_bytes(bytes(data))
    err = box.convert_checked(quant=target)
    assert isinstance(err, NonFiniteError), err
    assert err.file == str(f) and err.tensor == tensor


def test_non_finite_via_cli_names_file_and_tensor(checkpoint, tmp_path):
    box = Sandbox(checkpoint("tiny-k3"), tmp_path)
    tensor = "language_model.model.layers.1.post_attention_layernorm.weight"
    f = box.src / json.loads((box.src / "model.safetensors.index.json").read_text())["weight_map"][tensor]
    start, header = header_offsets(f)
    data = bytearray(f.read_bytes())
    at = start + header[tensor]["data_offsets"][0]
    data[at:at + 2] = value_bytes("BF16", float("nan"))
    f.write_bytes(bytes(data))
    before = snapshot(tmp_path, skip=box.out)
    assert_one_line_error(run_cli("shard", box.src, box.out, "--tp", "2"), f.name, tensor, "NaN/Inf")
    assert snapshot(tmp_path, skip=box.out) == before and not (box.out / MANIFEST).exists()


@pytest.mark.parametrize("damage", ["alias", "gap", "trailing"])
def test_overlapping_or_hidden_data_refused(sandbox, damage):
    f = sandbox.src / sandbox.shards[2]
    start, header = header_offsets(f)
    data = f.read_bytes()[start:]
    names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])
    size = {k: header[k]["data_offsets"][1] - header[k]["data_offsets"][0] for k in names}
    try:
        if damage == "alias":  # a later tensor of the same size pointed at an earlier one's bytes
            a, b = next((a, b) for i, a in enumerate(names) for b in names[i + 1:] if size[a] == size[b])
            header[b]["data_offsets"] = header[a]["data_offsets"]
        elif damage == "gap":
            header[names[0]]["data_offsets"] = [x + 1 for x in header[names[0]]["data_offsets"]]
        else:
            data += b"\0" * 16
        write_header(f, header, data)
        err = sandbox.convert_checked()
        assert err is not None and f.name in err.one_line()
    finally:
        sandbox.restore()


@pytest.mark.parametrize("bad", ["../outside.safetensors", "/tmp/x.safetensors"])
def test_index_escaping_the_checkpoint_refused(sandbox, bad):
    index_file = sandbox.src / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = bad
    index_file.write_text(json.dumps(index))
    try:
        err = sandbox.convert_checked()
        assert err is not None and bad in err.one_line()
    finally:
        sandbox.restore()


# ------------------------------------------------------------------------------------ seeded campaign


def _damage_source(rng: random.Random, f: Path) -> str:
    """Damage shard `f` one random way; return what was done (for the failure message)."""
    data = bytearray(f.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    kind = rng.choice(["header_byte", "header_byte", "header_byte", "length", "truncate", "append", "nonfinite",
                       "field", "field"])
    if kind == "header_byte":
        pos = rng.randrange(8, 8 + n)
        data[pos] = (data[pos] + rng.randrange(1, 256)) % 256
        what = f"header byte {pos}"
    elif kind == "length":
        new = rng.choice([0, 1, n - 1, n + 1, n + 8, n - 8, 2**64 - 1, rng.randrange(2**63), len(data)])
        data[:8] = struct.pack("<Q", max(0, new))
        what = f"header length {n} -> {new}"
    elif kind == "truncate":
        cut = rng.randrange(0, len(data))
        del data[cut:]
        what = f"truncated to {cut}"
    elif kind == "append":
        data += bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
        what = "trailing bytes"
    elif kind == "nonfinite":
        header = json.loads(data[8:8 + n])
        name = rng.choice(sorted(k for k, v in header.items() if k != "__metadata__" and v["dtype"] in FLOATS))
        spec = header[name]
        raw = value_bytes(spec["dtype"], rng.choice([float("nan"), float("inf"), float("-inf")]))
        count = (spec["data_offsets"][1] - spec["data_offsets"][0]) // len(raw)
        at = 8 + n + spec["data_offsets"][0] + rng.randrange(count) * len(raw)
        data[at:at + len(raw)] = raw
        what = f"non-finite value in {name}"
    else:
        header = json.loads(data[8:8 + n])
        name = rng.choice(sorted(k for k in header if k != "__metadata__"))
        spec = header[name]
        edit = rng.choice(["dtype", "shape", "offset", "name", "drop", "offsets_type"])
        if edit == "dtype":
            spec["dtype"] = rng.choice(["F16", "I16", "U16", "F32", "I32", "F8_E4M3", "BOOL", "Q4", 7])
        elif edit == "shape":
            spec["shape"] = rng.choice([spec["shape"][::-1], spec["shape"] + [1], [], [-1], ["4"], 3,
                                        [s * 2 for s in spec["shape"]], [10**12]])
        elif edit == "offset":
            d = rng.choice([-2, -1, 1, 2, 10**9])
            spec["data_offsets"] = [spec["data_offsets"][0] + d, spec["data_offsets"][1] + d]
        elif edit == "name":
            header[name.replace(".weight", ".weigth")] = header.pop(name)
        elif edit == "drop":
            del header[name]
        else:
            spec["data_offsets"] = rng.choice([None, "0", [1.5, 2], [0], {}])
        data = bytearray()
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        data += struct.pack("<Q", len(raw)) + raw + f.read_bytes()[8 + n:]
        what = f"header field {edit} of {name}"
    f.write_bytes(bytes(data))
    return f"{kind}: {what}"


def test_campaign_source_shards(sandbox):
    rng = random.Random(SEED)
    tally = {"refused": 0, "converted": 0}
    for case in range(N_SOURCE):
        f = sandbox.src / rng.choice(sandbox.shards)
        what = f"case {case}, {f.name}: " + _damage_source(rng, f)
        lib = library_reads(f)
        try:
            if case % CLI_EVERY == 0:
                _check_cli_shard(sandbox, what, run_cli if case == 0 else cli_here)
            err = sandbox.convert_checked()
            if err is None:  # converted: only a file the library reads, and read exactly as the library does
                assert lib is not None, f"{what}: converted a file the safetensors library refuses"
                assert "non-finite" not in what, f"{what}: converted"
                ck = Checkpoint.open(sandbox.src)
                for name, t in lib.items():
                    mine = ck.read(name) if ck.logical.get(name) and ck.logical[name].format == "plain" else None
                    assert mine is None or torch.equal(mine, t), f"{what}: {name} read differently"
                verify_files(sandbox.out)
            tally["refused" if err else "converted"] += 1
        finally:
            sandbox.restore()
    assert tally["refused"] >= N_SOURCE * 0.8, tally


def _check_cli_shard(sandbox: Sandbox, what: str, cli) -> None:
    """`kconvert shard` on the damaged source through `cli` (run_cli: a process; cli_here: main() in this one)."""
    before = snapshot(sandbox.root, skip=sandbox.out)
    r = cli("shard", sandbox.src, sandbox.out, "--tp", "2", "--quant", "fp8", "--json")
    assert r.returncode in (0, 2) and "Traceback" not in r.stderr, (what, r.stderr)
    if r.returncode == 2:
        assert len(r.stderr.strip().splitlines()) == 1 and not (sandbox.out / MANIFEST).exists(), (what, r.stderr)
    assert snapshot(sandbox.root, skip=sandbox.out) == before, what
    shutil.rmtree(sandbox.out, ignore_errors=True)


@pytest.fixture(scope="module")
def converted(checkpoint, tmp_path_factory):
    """Two finished conversions of tiny-k3 (tp 2 fp8: plain shards; tp 2 none: zstd-compressed shards)."""
    root = tmp_path_factory.mktemp("converted")
    outs = []
    for name, kw in (("fp8", {"quant": "fp8"}), ("zstd", {"quant": "none", "compress": "zstd:3"})):
        out = root / name
        assert convert(checkpoint("tiny-k3"), out, **kw) is None
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


# ------------------------------------------------------------------------------ kconvert.json itself

def _edit_tp(meta):
    meta["layout"]["tp"] = 3


def _edit_config(meta):
    meta["config"]["text_config"]["num_hidden_layers"] = 2


def _edit_path(meta):
    rel = next(iter(meta["files"]))
    meta["files"]["../" + rel] = meta["files"].pop(rel)


def _edit_tensor(meta):
    meta["tensors"][0]["shape"] = [1]


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


def _file_size_limit(limit: int):
    def apply() -> None:  # in the child, before exec: ignored signals stay ignored across exec
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def test_disk_full_is_a_clean_error_and_resumable(checkpoint, tmp_path):
    src = checkpoint("tiny-dsv32")
    ref = tmp_path / "ref"
    assert convert(src, ref) is None
    sizes = {rel: rec["bytes"] for rel, rec in json.loads((ref / MANIFEST).read_text())["files"].items()}
    first = [rel for rel in sizes if rel.endswith(("globals.safetensors", "layer-0000.safetensors"))]
    limit = max(sizes[rel] for rel in first)  # the first two units fit; the MoE layers after them do not
    assert limit < min(v for rel, v in sizes.items() if rel not in first)
    shutil.rmtree(ref)
    out = tmp_path / "out"
    args = [sys.executable, "-m", "cli.main", "shard", str(src), str(out), "--tp", "2", "--quant", "fp8"]
    r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300,
                       preexec_fn=_file_size_limit(limit), env=os.environ.copy())
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr and "layer-0001.safetensors" in lines[0], r.stderr
    assert "disk full" in lines[0] and "re-run" in lines[0], lines[0]  # the message says it resumes
    assert not (out / MANIFEST).exists()
    assert not list(out.rglob(".*.tmp-*")), "a temporary file was left behind"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    again = shard(ShardJob(str(src), str(out), 2, quant="fp8"))  # the same job, no limit: it resumes and finishes
    assert again.files_resumed == len(first) and again.files_written == len(sizes) - len(first)
    verify_files(out)


# ------------------------------------------------------------- the fsync policy (workers never fsync)


def _trace_durability(monkeypatch) -> list[tuple]:
    """Record, in order, every fsync (by the path its descriptor names), rename and journal append."""
    import threading

    from kconvert.converted.journal import JournalLog

    events: list[tuple] = []
    lock = threading.Lock()
    real_fsync, real_replace, real_add = os.fsync, os.replace, JournalLog.add_all

    def fsync(fd):
        real_fsync(fd)
        with lock:
            events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))

    def replace(a, b):
        real_replace(a, b)
        with lock:
            events.append(("rename", str(a), str(b)))

    def add_all(self, records):
        with lock:
            events.append(("journal", [r["file"] for r in records]))
        real_add(self, records)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(JournalLog, "add_all", add_all)
    return events


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to name a descriptor's file")
def test_a_file_is_journalled_only_after_fsync_rename_and_directory_fsync(checkpoint, tmp_path, monkeypatch):
    """Workers write units without waiting for the disk; what makes a unit durable moved to the thread
    that journals. The resume guarantee needs, for every journalled file, in this order: its bytes
    fsynced (under the temporary name), the rename to the final name, its directory fsynced, and only
    then the journal line that lets a re-run skip it."""
    events = _trace_durability(monkeypatch)
    out = (tmp_path / "out").resolve()
    assert convert(checkpoint("tiny-dsv32"), out, tp=2) is None
    journalled = [(i, rel) for i, e in enumerate(events) if e[0] == "journal" for rel in e[1]]
    assert len(journalled) == len(json.loads((out / MANIFEST).read_text())["files"])
    for at, rel in journalled:
        final = out / rel
        renames = [i for i, e in enumerate(events[:at]) if e[0] == "rename" and e[2] == str(final)]
        assert renames, f"{rel} journalled before it was renamed into place"
        tmp = Path([e for e in events if e[0] == "rename" and e[2] == str(final)][0][1])
        assert tmp.name.startswith(f".{final.name}.tmp-")
        synced = [i for i, e in enumerate(events[:renames[-1]]) if e == ("fsync", str(tmp))]
        assert synced, f"{rel} renamed into place before its bytes were fsynced"
        dir_synced = [i for i in range(renames[-1], at) if events[i] == ("fsync", str(final.parent))]
        assert dir_synced, f"{rel} journalled before its directory entry was fsynced"


def test_fsync_failure_journals_none_of_the_unit_and_resumes(checkpoint, tmp_path, monkeypatch):
    """A unit whose fsync fails (the disk reports an I/O error) is not journalled, leaves no temporary
    and no kconvert.json; units made durable before it are kept, and the same command resumes to the
    same bytes as an uninterrupted run."""
    import errno

    src = checkpoint("tiny-dsv32")
    ref, out = tmp_path / "ref", tmp_path / "out"
    assert convert(src, ref, tp=2) is None
    real_fsync = os.fsync

    def failing(fd):
        if ".layer-0001.safetensors.tmp-" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", failing)
    err = convert(src, out, tp=2)
    assert err is not None and "layer-0001.safetensors" in err.one_line() and "cannot write" in err.one_line()
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert not (out / MANIFEST).exists()
    assert not list(out.rglob(".*.tmp-*")), "a temporary file was left behind"
    lines = "".join(p.read_text() for p in (out / ".kconvert").glob("done-*.jsonl"))
    kept = [json.loads(line)["file"] for line in lines.splitlines()]
    assert kept and not any("layer-0001" in rel for rel in kept)
    again = shard(ShardJob(str(src), str(out), 2, quant="fp8"))
    assert again.files_resumed == len(kept)
    verify_files(out)
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*.safetensors")} == \
        {p.relative_to(ref): p.read_bytes() for p in ref.rglob("*.safetensors")}
