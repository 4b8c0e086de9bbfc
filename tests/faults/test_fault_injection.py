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

This file: damaged sources. test_fault_injection_converted.py: damaged converted directories;
test_fault_injection_writes.py: failing writes (disk full, fsync errors) and the fsync order;
test_fault_injection_inputs.py: odd side files (FIFOs, devices, deep JSON), export's copy paths, arguments.
"""

from __future__ import annotations

import json
import random
import shutil
import struct
from pathlib import Path

import pytest
import torch

from faults import CLI_EVERY, FLOATS, MANIFEST, SEED, Sandbox, library_reads, snapshot, value_bytes, write_header
from helpers import assert_one_line_error, cli_here, header_offsets, run_cli
from kconvert.disk_format.integrity import verify_files
from kconvert.errors import NonFiniteError
from kconvert.source.checkpoint import Checkpoint

N_SOURCE = 130


@pytest.fixture(scope="module")
def sandbox(checkpoint, tmp_path_factory):
    box = Sandbox(checkpoint("tiny-k25-dsv32"), tmp_path_factory.mktemp("faults"))
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
    box = Sandbox(checkpoint("tiny-k25-dsv32-fp8"), tmp_path)
    config = json.loads((box.src / "config.json").read_text())
    qc = config.get("quantization_config") or config["text_config"]["quantization_config"]
    qc["weight_block_size"] = block
    (box.src / "config.json").write_text(json.dumps(config))
    err = box.convert_checked(requantize=True)
    assert err is not None and "weight_block_size" in err.one_line()


NON_FINITE = [  # (fixture, stored tensor, value, target): kept in bf16, in fp32, a scale, an fp8 weight, an INT4 scale
    ("tiny-k25-dsv32", "language_model.model.layers.0.input_layernorm.weight", float("nan"), "none"),
    ("tiny-k25-dsv32", "language_model.model.norm.weight", float("inf"), "fp8"),
    ("tiny-k25-dsv32", "language_model.lm_head.weight", float("-inf"), "fp8"),
    ("tiny-k25-dsv32", "language_model.model.layers.2.mlp.gate.e_score_correction_bias", float("nan"), "int8"),
    ("tiny-k25-dsv32", "vision_tower.encoder.blocks.1.wqkv.bias", float("nan"), "fp8"),
    ("tiny-k25-dsv32", "language_model.model.layers.1.mlp.experts.4.up_proj.weight", float("inf"), "fp8"),
    ("tiny-k25-dsv32-fp8", "language_model.model.layers.1.self_attn.kv_b_proj.weight_scale_inv", float("nan"), "fp8"),
    ("tiny-k25-dsv32-fp8", "language_model.model.layers.1.self_attn.kv_b_proj.weight_scale_inv", float("inf"), "none"),
    ("tiny-k25-dsv32-fp8", "language_model.model.layers.2.mlp.experts.0.gate_proj.weight", "fp8-nan", "fp8"),
    ("tiny-k25-dsv32-int4", "language_model.model.layers.2.mlp.experts.7.gate_proj.weight_scale", float("nan"), "fp8"),
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
    box = Sandbox(checkpoint("tiny-k25-dsv32"), tmp_path)
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


