"""`kconvert export`: every exported tensor dequantized by the formats' own implementations
(compressed-tensors' decompressors, transformers' fine-grained FP8 loading) equals kconvert's reading
of it; the transformers-loaded export's KLD to the source matches what `kconvert verify` reports; the
exports read back through inspect and shard; resume, atomicity and bad input; `kconvert verify` of an export
(its format, its budget, its faithfulness reference, damaged exports FAIL). Over 300 lines: the verify tests
share this module's exports (making them again would cost ~30 s)."""

from __future__ import annotations

import json
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import assert_one_line_error, cli_here, load_source, one_thread, run_cli
from kconvert.convert.export.job import ExportJob, export
from kconvert.source.checkpoint import Checkpoint

CT_FORMATS = ("w4a16", "w8a8-int8", "fp8-channel")


@pytest.fixture(scope="module")
def exported(checkpoint, tmp_path_factory):
    base = tmp_path_factory.mktemp("export")
    src = checkpoint("tiny-k25-dsv32")
    return {fmt: export(ExportJob(str(src), str(base / fmt), fmt)).out for fmt in ("fp8-block", *CT_FORMATS)}


def _modules(out: str) -> tuple[dict, dict[str, dict[str, torch.Tensor]]]:
    """(quantization_config, {module: its stored tensors by local name}), read with safetensors itself."""
    qc = json.loads((Path(out) / "config.json").read_text())["quantization_config"]
    mods: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in load_source(Path(out)).items():
        module, local = name.rsplit(".", 1)
        mods.setdefault(module, {})[local] = t
    return qc, mods


@pytest.mark.parametrize("fmt", CT_FORMATS)
def test_compressed_tensors_decompress_equals_kconvert(exported, checkpoint, fmt):
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    qc, mods = _modules(exported[fmt])
    group = qc["config_groups"]["group_0"]
    scheme = QuantizationScheme(targets=group["targets"], weights=group["weights"],
                                input_activations=group["input_activations"])
    compressor = BaseCompressor.load_from_registry(qc["format"])
    ours, src = Checkpoint.open(exported[fmt]), Checkpoint.open(checkpoint("tiny-k25-dsv32"))
    quantized = {m for m, d in mods.items() if "weight_scale" in d}
    assert len(quantized) == (96 if fmt == "w4a16" else 126)  # w4a16: routed experts only
    for module in sorted(quantized):
        theirs = compressor.decompress(mods[module], scheme)["weight"]
        mine = ours.read(module + ".weight").to(theirs.dtype)
        assert torch.equal(theirs, mine), module
        # and it is a quantization of the source: error within half a step (plus the int4 clip at +7.5)
        x = src.read(module + ".weight", dtype=torch.float32)
        scale = mods[module]["weight_scale"].float()
        step = scale.repeat_interleave(x.shape[1] // scale.shape[1], 1) if fmt == "w4a16" else scale
        bound = (1.0 if fmt == "w4a16" else 0.5) * step + (0.07 * x.abs() if fmt == "fp8-channel" else 0)
        assert bool(((theirs.float() - x).abs() <= bound + 1e-6).all()), module
    # every linear kept in bf16 is on the ignore list, no quantized one is
    ignore = [re.compile(p[3:]) for p in qc["ignore"]]
    for module, d in mods.items():
        linear = d.get("weight") is not None and d["weight"].dim() == 2 and not re.search(r"(norm|embed_tokens)$", module)
        if linear or module in quantized:
            assert any(p.fullmatch(module) for p in ignore) == (module not in quantized), module


def test_fp8_block_through_transformers_equals_kconvert(exported):
    """transformers' own fine-grained FP8 path (dequantized on CPU, needs accelerate) reads every weight
    as kconvert dequantizes it."""
    import transformers

    out = exported["fp8-block"]
    qc = json.loads((Path(out) / "config.json").read_text())["quantization_config"]
    kept = qc.pop("modules_to_not_convert")  # the vision tower and projector, by name: vLLM builds them FP8 else
    assert qc == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
    assert "vision_tower.encoder.blocks.0.wqkv" in kept and "mm_projector.proj.0" in kept
    assert not [m for m in kept if m.startswith("language_model.")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32)
    hf = dict(model.state_dict())
    ours = Checkpoint.open(out)
    fp8 = [n for n, t in ours.logical.items() if t.format == "block_fp8"]
    assert len(fp8) == 126 and not {n[: -len(".weight")] for n in fp8} & set(kept)
    experts: dict[str, dict[int, torch.Tensor]] = {}
    # transformers 5.23 derives the block size from the scale grid (rows // grid rows), which is wrong for
    # partial edge blocks (kv_a_proj_with_mqa: 192 rows -> 96-row blocks); those it cannot judge
    partial = [n for n in fp8 if any(d % 128 and d > 128 for d in ours.logical[n].shape)]
    assert all("kv_a_proj_with_mqa" in n for n in partial)
    for name in sorted(set(fp8) - set(partial)):  # transformers names: model.language_model.layers.L..., routed experts fused per layer
        mine = ours.read(name, dtype=torch.float32)
        m = re.fullmatch(r"language_model\.model\.(layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+)_proj\.weight", name)
        if m is None:
            theirs = hf["model.language_model." + name[len("language_model.model."):]]
            assert torch.equal(theirs.float(), mine), name
            continue
        experts.setdefault(f"model.language_model.{m[1]}.{m[3]}", {})[int(m[2])] = mine
    for key, by_expert in experts.items():
        if key.endswith(".down"):
            theirs, mine = hf[key + "_proj"], torch.stack([by_expert[e] for e in sorted(by_expert)])
        else:
            if not key.endswith(".gate"):
                continue
            up = experts[key[: -len("gate")] + "up"]
            theirs = hf[key + "_up_proj"]
            mine = torch.stack([torch.cat([by_expert[e], up[e]]) for e in sorted(by_expert)])
        assert torch.equal(theirs, mine), key


def test_fp8_block_source_is_copied_bit_for_bit(checkpoint, tmp_path):
    src = checkpoint("tiny-k25-dsv32-fp8")
    out = export(ExportJob(str(src), str(tmp_path / "o"), "fp8-block")).out
    a, b = load_source(src), load_source(tmp_path / "o")
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), name
    assert json.loads((tmp_path / "o" / "config.json").read_text())["quantization_config"]["fmt"] == "e4m3"
    assert out


def test_transformers_kld_equals_kconvert_verify(exported, checkpoint, tmp_path):
    """KLD(bf16 source || export loaded by transformers) ≈ what `kconvert verify` of the export reports."""
    from kconvert.verify import kld
    from kconvert.verify.prompts import prompts_for
    from kconvert.verify.reference import load_reference, run_reference

    src = checkpoint("tiny-k25-dsv32")
    prompts = [p for p in prompts_for(Checkpoint.open(src).config) if p.get("kind") != "image"][:2]
    (tmp_path / "p.json").write_text(json.dumps(prompts))
    ref, got = tmp_path / "ref.safetensors", tmp_path / "exp.safetensors"
    run_reference(str(src), ref, prompts)
    run_reference(exported["fp8-block"], got, prompts, dtype="bfloat16")  # its fp8 dequantizes to bf16 on CPU
    _, refs, _ = load_reference(ref)
    _, tests, _ = load_reference(got)
    hf = kld.summarize(kld.concat([kld.compare(r, t.full) for r, t in zip(refs, tests)])).to_json()["mean_kld"]
    proc = run_cli("verify", exported["fp8-block"], "--reference", ref, "--json")
    assert proc.returncode == 0, proc.stderr
    engine = json.loads(proc.stdout)["cost"]["overall"]["mean_kld"]
    assert hf > 1e-6 and engine > 1e-6  # quantization did something measurable
    assert abs(hf - engine) <= 0.2 * max(hf, engine), (hf, engine)


def test_inspect_and_shard_read_exports_back(exported, checkpoint, tmp_path):
    from click.testing import CliRunner

    from cli.main import app
    from helpers import shard_job
    from kconvert.convert.shard.job import shard

    def inspect(path) -> dict:
        res = CliRunner().invoke(app, ["inspect", str(path), "--json"])
        assert res.exit_code == 0, res.output
        return json.loads(res.output)

    from kconvert.convert.export.table import EXPORT_FORMATS

    src = inspect(checkpoint("tiny-k25-dsv32"))
    assert src["quantization"] is None
    for fmt, out in exported.items():
        got = inspect(out)
        assert got["total_params"] == src["total_params"] and got["params"] == src["params"], fmt
        assert got["quantization"] == {"format": fmt, "scheme": EXPORT_FORMATS[fmt].scheme}, fmt
        assert shard(shard_job(out, tmp_path / fmt, tp=2)).files_written > 0
        index = json.loads((Path(out) / "model.safetensors.index.json").read_text())
        sizes = sum(t.numel() * t.element_size() for t in load_source(Path(out)).values())
        assert index["metadata"]["total_size"] == sizes
        assert sorted(set(index["weight_map"].values())) == ["model-00001-of-00001.safetensors"]


def test_interrupted_export_resumes_and_never_looks_complete(checkpoint, tmp_path, monkeypatch):
    import kconvert.convert.export.job as ex

    src, out = checkpoint("tiny-k25-dsv32"), tmp_path / "o"
    job = ExportJob(str(src), str(out), "w8a8-int8", max_shard_bytes=2_000_000, workers=2)
    real, calls = ex.produce, []

    def dying(e, x):
        calls.append(e.src)
        if len(calls) == 120:
            raise KeyboardInterrupt
        return real(e, x)

    monkeypatch.setattr(ex, "produce", dying)
    with pytest.raises(KeyboardInterrupt):
        export(job)
    monkeypatch.setattr(ex, "produce", real)
    assert not (out / "model.safetensors.index.json").exists() and not (out / "config.json").exists()
    assert not list(out.glob(".*.tmp-*"))
    r = export(job)
    assert r.files_resumed >= 1 and r.files_written + r.files_resumed == r.details.files >= 3
    fresh = export(ExportJob(str(src), str(tmp_path / "fresh"), "w8a8-int8", max_shard_bytes=2_000_000))
    for f in sorted(out.glob("model-*.safetensors")):
        assert f.read_bytes() == (tmp_path / "fresh" / f.name).read_bytes(), f.name
    assert export(job).already_complete and fresh.details.files == r.details.files


def test_nan_in_source_is_one_line_naming_the_tensor(checkpoint, copy_checkpoint, tmp_path):
    from safetensors.torch import save_file

    src = copy_checkpoint(checkpoint("tiny-k25-dsv32"))
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    name = "language_model.model.layers.1.mlp.experts.3.up_proj.weight"
    f = src / index[name]
    tensors = load_file(f)
    tensors[name][0, 0] = float("nan")
    save_file(tensors, str(f), metadata={"format": "pt"})
    proc = run_cli("export", src, tmp_path / "o", "--format", "w4a16")
    assert_one_line_error(proc, name)
    assert not (tmp_path / "o" / "model.safetensors.index.json").exists()


def _by_the_doc(fmt: str, w: torch.Tensor, scale_fmt: str = "fp32", group: int = 32):
    """docs/EXPORT.md's formulas on the whole tensor at once (scales expanded to the weight's shape,
    explicit clamps): the reference for the chunked, broadcasting quantizers."""
    x = w.float()
    r, c = x.shape
    if fmt == "fp8-block":
        br, bc = -(-r // 128), -(-c // 128)
        padded = torch.zeros(br * 128, bc * 128)
        padded[:r, :c] = x.abs()
        s = (padded.view(br, 128, bc, 128).amax(dim=(1, 3)) / 448).clamp_min(1e-12)
        if scale_fmt == "ue8m0":
            s = torch.exp2(torch.ceil(torch.log2(s)))
        full = s.repeat_interleave(128, 0)[:r].repeat_interleave(128, 1)[:, :c]
        return (x / full).clamp(-448, 448).to(torch.float8_e4m3fn), s
    if fmt in ("w8a8-int8", "fp8-channel"):
        top = 127 if fmt == "w8a8-int8" else 448
        s = (x.abs().amax(dim=1, keepdim=True) / top).clamp_min(1e-12)
        y = (x / s).round() if fmt == "w8a8-int8" else x / s
        return y.clamp(-top, top).to(torch.int8 if fmt == "w8a8-int8" else torch.float8_e4m3fn), s
    s = (x.view(r, c // group, group).abs().amax(-1) / 7.5).to(torch.bfloat16)
    s = torch.where(s > 0, s, torch.full_like(s, 1e-12))
    q = (x.view(r, c // group, group) / s.float()[..., None]).round().clamp(-8, 7).to(torch.int64) + 8
    words = (q.view(r, c // 8, 8) << (torch.arange(8) * 4)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32), s


@pytest.mark.parametrize("chunk", [1 << 20, 4096])  # the default, and chunks far smaller than a 128-row block band
def test_quantizers_equal_the_documented_formulas(chunk, monkeypatch):
    """The quantizers work in row chunks with broadcast scales and no clamp (|x / s| cannot pass the
    limit by more than rounding); the stored bytes must equal the formulas applied to the whole tensor.
    Inputs where many entries equal their block's amax put x / s at or just above the limit."""
    from kconvert.quant import chunks
    from kconvert.quant.fp8_block import quantize_fp8_block
    from kconvert.quant.fp8_channel import quantize_fp8_channel
    from kconvert.quant.int4_group import quantize_int4_packed
    from kconvert.quant.int8_channel import quantize_int8_channel

    monkeypatch.setattr(chunks, "CHUNK_ELEMS", chunk)
    g = torch.Generator().manual_seed(7)
    for shape in [(130, 260), (384, 256), (5, 96), (257, 1056)]:
        for mag in (1e-30, 1e-3, 1.0, 3e4, 1e36):
            w = torch.randn(*shape, generator=g) * mag
            at_max = torch.rand(*shape, generator=g) < 0.3
            w[at_max] = w.abs().max() * torch.where(torch.rand(*shape, generator=g) < 0.5, -1.0, 1.0)[at_max]
            w[1, :] = 0.0  # all-zero rows and blocks
            for dtype in (torch.float32, torch.bfloat16):
                x = w.to(dtype)
                pairs = {"fp8-block": quantize_fp8_block(x, 128, "fp32"),
                         "w8a8-int8": quantize_int8_channel(x),
                         "fp8-channel": quantize_fp8_channel(x),
                         **({"w4a16": quantize_int4_packed(x, 32)} if shape[1] % 32 == 0 else {})}
                ue8m0 = quantize_fp8_block(x, 128, "ue8m0")
                for fmt, (q, s) in [*pairs.items(), ("ue8m0", ue8m0)]:
                    want_q, want_s = _by_the_doc("fp8-block" if fmt == "ue8m0" else fmt, x,
                                                 "ue8m0" if fmt == "ue8m0" else "fp32")
                    assert q.dtype == want_q.dtype and torch.equal(q.view(torch.uint8) if q.element_size() == 1 else q,
                                                                   want_q.view(torch.uint8) if q.element_size() == 1 else want_q), (fmt, shape, mag, dtype)
                    assert torch.equal(s, want_s.to(s.dtype)), (fmt, shape, mag, dtype)


# --------------------------------------------------------------------------- verify of an export


@pytest.mark.parametrize("fmt", ("fp8-block", *CT_FORMATS))
def test_export_faithfulness_reference_is_exactly_the_export(exported, checkpoint, tmp_path, fmt):
    """The faithfulness reference of an export (the source fake-quantized by compressed-tensors with the export's
    rule and stored scales) holds the exported weights bit for bit (layer 1's attention, dense parts and experts 0-3,
    for time: the verify test below covers every weight through the logits); a damaged expert it does not."""
    from kconvert.verify import damage
    from kconvert.verify.fake_quant import export_values, stored_rule

    src, ours = Checkpoint.open(checkpoint("tiny-k25-dsv32")), Checkpoint.open(exported[fmt])
    rule = stored_rule(ours.quantization_config)

    def faithful(ck: Checkpoint, name: str) -> bool:
        return torch.equal(export_values(ck.logical[name], src.read(name, dtype=torch.float32), rule),
                           ck.read(name, dtype=torch.float32))

    names = [n for n in ours.logical if ".layers.1." in n and not re.search(r"\.experts\.([4-9]|1\d)\.", n)]
    assert len(names) > 12 and all(faithful(ours, name) for name in names)
    for case, apply in damage.EXPORT_CASES.items():
        bad = tmp_path / case.replace(" ", "_")
        shutil.copytree(exported[fmt], bad)
        apply(bad)
        assert not faithful(Checkpoint.open(bad), damage.EXPORT_EXPERT), case


@pytest.fixture(scope="module")
def few_ref(checkpoint, tmp_path_factory):
    """An unquantized reference of tiny-k25-dsv32 on two prompts (one long enough for DSA to select)."""
    from kconvert.verify.prompts import prompts_for

    src = checkpoint("tiny-k25-dsv32")
    d = tmp_path_factory.mktemp("few")
    prompts = [p for p in prompts_for(Checkpoint.open(src).config) if p["id"] in ("short-1", "chat-1")]
    (d / "prompts.json").write_text(json.dumps(prompts))
    assert cli_here("reference", src, "--out", d / "ref.safetensors", "--prompts", d / "prompts.json").returncode == 0
    return d / "ref.safetensors"


def _verify_export(out, *args) -> tuple[int, dict]:
    with one_thread():
        r = cli_here("verify", out, "--json", *args)
    assert r.stdout.strip().startswith("{"), r.stderr
    return r.returncode, json.loads(r.stdout)


def test_verify_of_an_export_names_its_format_and_budget_and_fails_damage(exported, checkpoint, few_ref, tmp_path,
                                                                          monkeypatch):
    """`kconvert verify EXPORT --reference REF` and `--against SRC` (the example of `export --help`): labelled
    w4a16, judged by int4's budget, faithful to the source fake-quantized with the export's scales (random
    weights: the cost budget is lifted for the damage); each damaged copy FAILs as "the conversion is wrong"."""
    from kconvert.verify import damage, prompts
    from kconvert.verify.reference import load_reference
    from kconvert.verify.verdict import thresholds

    few = load_reference(few_ref)[0]["prompts"]
    monkeypatch.setattr(prompts, "prompts_for", lambda config: few)  # --against runs the reference on these
    for given in (("--reference", few_ref), ("--against", checkpoint("tiny-k25-dsv32"))):
        code, rep = _verify_export(exported["w4a16"], *given)
        assert rep["scheme"] == "w4a16" and rep["cost"]["limits"] == thresholds()["cost"]["int4"], given
        faith = rep["faithfulness"]
        assert faith["verdict"] == "PASS" and faith["overall"]["mean_kld"] < 1e-6, (given, faith)
        assert "fake-quantized as w4a16 with the export's scales" in faith["reference"]
        assert rep["cost"]["overall"]["mean_kld"] > 100 * faith["overall"]["mean_kld"]
    lifted = ("--threshold", "mean_kld=10", "--threshold", "p99_kld=100", "--threshold", "same_top1_pct=0",
              "--threshold", "ppl_ratio=100")
    for case, apply in damage.EXPORT_CASES.items():
        bad = tmp_path / case.replace(" ", "_")
        shutil.copytree(exported["w4a16"], bad)
        apply(bad)
        code, rep = _verify_export(bad, "--reference", few_ref, *lifted)
        assert code == 1 and rep["faithfulness"]["verdict"] == "FAIL", (case, rep["faithfulness"]["overall"])
        assert rep["failures"][0].startswith("the conversion is wrong"), rep["failures"]


def test_verify_takes_the_kv_options_and_its_bar_counts_prompts(exported, few_ref, monkeypatch):
    """`verify --kv-dtype --kv-budget --kv-device-budget` (as chat and load take them) reach the engine's cache:
    a device budget under its two-page minimum is refused there, one of two pages changes no figure (the host
    tier is exact), a budget that is not a size is one line, exit 2. The bar counts the prompts of each phase
    (the faithfulness reference, the engine on its ranks), never `engine 0/?`."""
    import contextlib

    import cli.verify_cmd

    events = []

    @contextlib.contextmanager
    def recorder(*a, **k):
        yield lambda event, **kw: events.append((event, kw))

    monkeypatch.setattr(cli.verify_cmd, "byte_progress", recorder)
    runs = [_verify_export(exported["fp8-block"], "--reference", few_ref, "--kv-dtype", "fp8", *extra)[1]
            for extra in ((), ("--kv-budget", "1GiB", "--kv-device-budget", "192KiB"))]
    starts = [i for i, (e, kw) in enumerate(events) if e == "phase" and kw["name"].startswith("reshard the fp8-block")]
    first = events[:starts[1]]  # the first run's events
    for name in ("faithfulness reference (fake-quantized source)", "engine on 1 rank"):
        at = first.index(("phase", {"name": name}))
        assert first[at + 1] == ("start", {"total": 2, "restart": True}), first[at:at + 2]
        assert first[at + 2:at + 4] == [("advance", {"n": 1})] * 2, first[at:at + 5]
    assert runs[0]["cost"]["overall"] == runs[1]["cost"]["overall"]
    r = cli_here("verify", exported["fp8-block"], "--reference", few_ref, "--kv-device-budget", "96KiB")
    assert_one_line_error(r, "--kv-device-budget 98304 B holds", "at least 2 are needed")
    r = cli_here("verify", exported["fp8-block"], "--reference", few_ref, "--kv-budget", "lots")
    assert_one_line_error(r, "--kv-budget 'lots'")
