"""Fault injection, second pass (issue 28): what the first pass did not aim at.

Side files that are not files (a FIFO blocks a reader forever; a character device never ends), huge ones,
JSON nested past any real config and numbers past Python's digit limit, in a seeded campaign over every side
file a source has, and kconvert.json / --reference; export's lossless copy paths under the checks shard makes;
nonsense command-line arguments. Each case: one line, exit 2, within 30 s (a hang fails the case), nothing
complete-looking written. Lifecycle cases (temporary work, stopped ranks, --nproc, swapped rank files):
test_run_lifecycle.py."""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path

import pytest

from faults import MANIFEST, SEED, Sandbox, value_bytes
from helpers import assert_one_line_error, cli_here, header_offsets


@pytest.fixture(scope="module")
def sandbox(checkpoint, tmp_path_factory):
    box = Sandbox(checkpoint("tiny-k25-dsv32"), tmp_path_factory.mktemp("faults_inputs"))
    yield box
    box.restore()


SIDE_FILES = ["config.json", "model.safetensors.index.json", "tokenizer_config.json", "tiktoken.model"]
SIDE_DAMAGE = ["fifo", "char_device", "deep_json", "huge", "long_number"]
N_SIDE = 20


def _damage_side_file(f: Path, kind: str) -> None:
    import os

    text = f.read_text() if f.exists() else "{}"
    f.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(f)
    elif kind == "char_device":
        f.symlink_to("/dev/zero")  # reads like /dev/zero forever
    elif kind == "deep_json":
        f.write_text("[" * 100_000 + "]" * 100_000)
    elif kind == "huge":  # sparse: past every side file's limit without writing the bytes
        f.write_text(text)
        os.truncate(f, 1 << 30)
    else:
        f.write_text('{"a": ' + "7" * 5000 + "}")


def _undamage(sandbox: Sandbox, f: Path) -> None:
    f.unlink(missing_ok=True)
    f.write_bytes(sandbox.pristine[f.name])
    sandbox.restore()


@pytest.mark.parametrize("text", [False, True], ids=["bytes", "str"])
def test_json_nested_one_past_the_bound_refused(tmp_path, text):
    """MAX_DEPTH levels read; one more is refused (the walk runs whenever the file holds more than MAX_DEPTH
    openings, also when many are in strings or side by side, and is skipped otherwise)."""
    from kconvert.errors import CheckpointError
    from kconvert.io.side_files import MAX_DEPTH, parse_json

    def nest(n: int) -> str:
        return '{"s": "' + "[{" * 40 + '", "a": [' + "[]," * 200 + "[" * (n - 2) + "1" + "]" * (n - 1) + "}"

    def enc(t: str) -> str | bytes:
        return t if text else t.encode()

    assert parse_json(enc(nest(MAX_DEPTH)), file="f")["s"].startswith("[{")
    assert len(parse_json(enc("[" * MAX_DEPTH + "]" * MAX_DEPTH), file="f")) == 1
    for deep in (nest(MAX_DEPTH + 1), "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1)):
        with pytest.raises(CheckpointError) as e:
            parse_json(enc(deep), file="f")
        assert e.value.one_line() == f"f: JSON nested deeper than {MAX_DEPTH} levels"


def test_campaign_side_files(sandbox, deadline):
    """FIFOs, character devices, deep JSON, huge files and 5000-digit numbers as each side file SRC has:
    `shard` refuses in one line naming the file (or, for a tokenizer file it only copies, refuses to copy
    a non-regular file); nothing complete-looking is left."""
    rng = random.Random(SEED + 28)
    cases = [(rng.choice(SIDE_FILES), rng.choice(SIDE_DAMAGE)) for _ in range(N_SIDE)]
    cases += [(name, kind) for name in SIDE_FILES[:2] for kind in SIDE_DAMAGE]  # every class on config and index
    for case, (name, kind) in enumerate(cases):
        f = sandbox.src / name
        try:
            _damage_side_file(f, kind)
            err = sandbox.convert_checked()
            tokenizer_copy = name in SIDE_FILES[2:] and kind in ("deep_json", "long_number")
            if err is None:  # shard copies tokenizer files as they are: only a regular one may pass
                assert tokenizer_copy, f"case {case}: {kind} {name} converted"
            else:
                assert name in err.one_line(), (case, kind, name, err.one_line())
        finally:
            _undamage(sandbox, f)


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
@pytest.mark.parametrize("kind", ["fifo", "deep_json"])
def test_side_file_damage_via_cli_is_one_line(sandbox, deadline, name, kind):
    f = sandbox.src / name
    try:
        _damage_side_file(f, kind)
        for args in (("inspect", sandbox.src), ("export", sandbox.src, sandbox.out, "--format", "w8a8-int8"),
                     ("plan", sandbox.src, "--tp", "2")):
            assert_one_line_error(cli_here(*args), name)
        assert not (sandbox.out / "model.safetensors.index.json").exists()
    finally:
        _undamage(sandbox, f)


@pytest.mark.parametrize("kind", ["fifo", "char_device", "deep_json", "huge"])
def test_converted_side_files_refused(checkpoint, tmp_path, deadline, kind):
    """kconvert.json and --reference through the same bounded reader."""
    from kconvert.disk_format.catalog import Catalog
    from kconvert.errors import KConvertError
    from kconvert.verify.reference import load_reference

    box = Sandbox(checkpoint("tiny-k25-dsv32"), tmp_path)
    assert box.convert_checked(tp=1, quant="none") is None
    _damage_side_file(box.out / MANIFEST, kind)
    for read in (lambda: Catalog.read(box.out), lambda: load_reference(box.out / MANIFEST)):
        with pytest.raises(KConvertError) as e:
            read()
        assert e.value.exit_code == 2 and MANIFEST in e.value.one_line()


# export's copy paths: the source checks shard applies (NaN/Inf parts, INT4 weight_shape, scale grids that
# do not follow the config's weight_block_size / group_size)
L28 = "language_model.model.layers"


def _poke(src: Path, tensor: str, raw: bytes, elem: int = 0) -> None:
    f = src / json.loads((src / "model.safetensors.index.json").read_text())["weight_map"][tensor]
    start, header = header_offsets(f)
    data = bytearray(f.read_bytes())
    at = start + header[tensor]["data_offsets"][0] + elem * len(raw)
    data[at:at + len(raw)] = raw
    f.write_bytes(bytes(data))


def _quant_config(src: Path, key: str, value) -> None:
    config = json.loads((src / "config.json").read_text())
    qc = config.get("quantization_config") or config["text_config"]["quantization_config"]
    if key == "group_size":
        qc["config_groups"]["group_0"]["weights"]["group_size"] = value
    else:
        qc[key] = value
    (src / "config.json").write_text(json.dumps(config))


EXPORT_COPY_CASES = [  # fixture, damage, format, what the one line names
    ("tiny-k25-dsv32-fp8", lambda s: _poke(s, f"{L28}.1.self_attn.kv_b_proj.weight_scale_inv", value_bytes("F32", float("nan"))),
     "fp8-block", "NaN/Inf"),
    ("tiny-k25-dsv32-fp8", lambda s: _poke(s, f"{L28}.2.mlp.experts.0.gate_proj.weight", b"\x7f", 3), "fp8-block", "NaN/Inf"),
    ("tiny-k25-dsv32-int4", lambda s: _poke(s, f"{L28}.2.mlp.experts.7.gate_proj.weight_scale", value_bytes("BF16", float("nan"))),
     "w4a16", "NaN/Inf"),
    ("tiny-k25-dsv32-int4", lambda s: _poke(s, f"{L28}.2.mlp.experts.7.gate_proj.weight_shape", struct.pack("<ii", 2**30, 2**30)),
     "w4a16", "weight_shape"),
    ("tiny-k25-dsv32-fp8", lambda s: _quant_config(s, "weight_block_size", [100, 100]), "fp8-block", "weight_block_size"),
    ("tiny-k25-dsv32-fp8", lambda s: _quant_config(s, "weight_block_size", [1, 1]), "w8a8-int8", "weight_block_size"),
    ("tiny-k25-dsv32-int4", lambda s: _quant_config(s, "group_size", 7), "w4a16", "group_size"),
]


@pytest.mark.parametrize("fixture,damage,fmt,needle", EXPORT_COPY_CASES)
def test_export_copy_paths_checked_like_shard(checkpoint, tmp_path, fixture, damage, fmt, needle):
    from kconvert.convert.export.job import ExportJob, export
    from faults import refused

    box = Sandbox(checkpoint(fixture), tmp_path)
    damage(box.src)
    err = refused(lambda: export(ExportJob(str(box.src), str(box.out), fmt)))
    assert err is not None and needle in err.one_line(), err
    assert not (box.out / "model.safetensors.index.json").exists()
    assert box.convert_checked() is not None  # and shard agrees


# nonsense arguments: one line, exit 2, nothing run
BAD_ARGS = [
    ("plan", "{src}", "--tp", "1", "--pp", "0"), ("plan", "{src}", "--tp", "1", "--pp", "-3"),
    ("plan", "{src}", "--tp", "1", "--reserve-gb", "-1e30"), ("plan", "{src}", "--tp", "1", "--host-gb", "-1"),
    ("plan", "{src}", "--tp", "1", "--mem-fraction", "nan"), ("plan", "{src}", "--tp", "1", "--context", "١٢٨"),
    ("plan", "{src}", "--tp", "1", "--context", "9" * 5000), ("shard", "{src}", "{out}", "--tp", "٢"),
    ("plan", "{src}", "--tp", "1", "--pp", "2", "--pp-layers", "0-" + "9" * 5000 + ",1"),
    ("export", "{src}", "{out}", "--format", "w4a16", "--group-size", "24"),
    ("export", "{src}", "{out}", "--format", "w4a16", "--group-size", "1000000"),
    ("export", "{src}", "{out}", "--format", "w8a8-int8", "--max-shard-size", "0"),
    ("export", "{src}", "{long_out}", "--format", "w8a8-int8"),
    ("fixture", "tiny-k25-dsv32", "{out}", "--seed", "1e23"),
]


def test_nonsense_arguments_are_one_line(sandbox):
    for args in BAD_ARGS:
        args = [a.format(src=sandbox.src, out=sandbox.out, long_out=sandbox.root / ("x" * 256)) for a in args]
        p = cli_here(*args)
        assert_one_line_error(p)
        assert not sandbox.out.exists() or not any(sandbox.out.iterdir()), args


@pytest.mark.parametrize("argv,needle", [
    (["--temperature", "nan"], "--temperature"), (["--temperature", "-1"], "--temperature"),
    (["--seed", "1e23"], "--seed"), (["--seed", str(2**70)], "--seed"), (["--top-p", "0"], "--top-p"),
    (["--context", "٣"], "--context"), (["--nproc", "0"], "--nproc"), (["--device", "bogus"], "bogus"),
    (["--max-new-tokens", "9" * 5000], "--max-new-tokens"), (["--no-such-flag"], "--no-such-flag"),
])
def test_chat_arguments_checked_before_loading(argv, needle):
    from engine.chat.args import parse_args
    from kconvert.errors import UsageError

    with pytest.raises(UsageError) as e:
        parse_args(["OUT", *argv])
    assert needle in e.value.one_line()


def test_image_path_too_long_is_one_line():
    from engine.inputs.image import load_image
    from kconvert.errors import ImageError

    with pytest.raises(ImageError):
        load_image("/tmp/" + "p" * 5000)
