"""Pipeline stages in conversion, plan and loader (issue 15; the split itself: test_pipeline_split.py):
tp x pp conversions of tiny fixtures checked tensor by tensor against the source, pp = 1 unchanged,
a stage's loader reading only its own files, resume refused on a changed pp, and the (tp, pp) search on
the bundled 3T example."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from helpers import assert_one_line_error, load_source, read_meta, run_cli, shard_job
from test_shard import deepseek_slice

from kconvert.errors import LoaderError, UsageError
from kconvert.io.dtypes import ITEMSIZE

BIG = "k25-dsv32-3t"


# ------------------------------------------------------------------ tp x pp conversions of tiny fixtures
@pytest.fixture(scope="module")
def four_layers(checkpoint):
    """tiny-dsv32 with 4 decoder layers (tiny presets have 3; tp 1 x pp 4 needs one layer per stage)."""
    return checkpoint("tiny-dsv32-4l")


@pytest.fixture(scope="module")
def converted(checkpoint, tmp_path_factory):
    """converted(preset, tp, pp, quant="none") -> OUT, converted in this process once per module (the CLI
    path of shard --pp is exercised by the tests that use run_cli)."""
    from helpers import shard_job
    from kconvert.convert.shard.job import shard

    made: dict[tuple, Path] = {}

    def get(preset: str, tp: int, pp: int, quant: str = "none") -> Path:
        key = (preset, tp, pp, quant)
        if key not in made:
            out = tmp_path_factory.mktemp("conv") / f"{preset}-tp{tp}-pp{pp}-{quant}"
            shard(shard_job(checkpoint(preset), out, tp=tp, pp=pp, quant=quant))
            made[key] = out
        return made[key]

    return get


def stage_tensors(out: Path, meta: dict, rank: int) -> dict:
    d = {}
    for rel, rec in meta["files"].items():
        if rec["rank"] == rank:
            d.update({(rec["unit"], k): v for k, v in load_file(out / rel).items()})
    return d


def check_against_source(src: Path, out: Path, tp: int, pp: int) -> dict:
    """Every rank of a tp x pp conversion holds exactly DeepSeek's tp slice of its stage's tensors."""
    meta = json.loads((out / "kconvert.json").read_text())
    lay = meta["layout"]
    assert (lay["tp"], lay["pp"], lay["world_size"], len(lay["stages"])) == (tp, pp, tp * pp, pp)
    source = load_source(src)
    n_experts = json.loads((src / "config.json").read_text())["n_routed_experts"]
    n_layers = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    layers_of = [sorted(int(u[6:]) for u in st["units"] if u.startswith("layer-")) for st in lay["stages"]]
    assert sum(layers_of, []) == list(range(n_layers)) and all(layers_of)
    for rank in range(tp * pp):
        stage, tp_rank = divmod(rank, tp)
        got = {name: t for (_, name), t in stage_tensors(out, meta, rank).items()}
        want = {}
        for n, w in source.items():
            layer = int(n.split(".layers.")[1].split(".")[0]) if ".layers." in n else None
            if layer is not None and layer not in layers_of[stage]:
                continue
            if layer is None and not ((stage == 0 and "embed_tokens" in n)
                                      or (stage == pp - 1 and "embed_tokens" not in n)):
                continue
            want[n] = deepseek_slice(n, w, tp_rank, tp, n_experts)
        want = {n: w for n, w in want.items() if w is not None}
        assert set(got) == set(want), (rank, sorted(set(got) ^ set(want))[:5])
        for name, w in want.items():
            assert got[name].dtype == w.dtype and got[name].equal(w), (rank, name)
        assert all(rec["stage"] == rec["rank"] // tp for rec in meta["files"].values())
    return meta


def test_tp2_pp2_holds_each_stage_slice_and_edges(checkpoint, converted):
    from kconvert.disk_format.integrity import verify_files

    src, out = checkpoint("tiny-dsv32"), converted("tiny-dsv32", 2, 2)
    meta = check_against_source(src, out, 2, 2)
    # the byte-balanced split of tiny-dsv32: dense layer 0 is light, so it shares stage 0 with layer 1
    assert meta["layout"]["stages"] == [{"units": ["globals", "layer-0000", "layer-0001"]},
                                        {"units": ["globals", "layer-0002"]}]
    assert meta["job"]["pp"] == 2 and meta["job"]["pp_layers"] == "0-1,2-2"
    assert verify_files(out)["files"] == len(meta["files"]) == 2 * 3 + 2 * 2  # globals on both stages


def test_tp1_pp4_with_a_pp_layers_override(four_layers, tmp_path):
    out = tmp_path / "tp1pp4"
    run_cli("shard", four_layers, out, "--tp", 1, "--pp", 4, "--pp-layers", "0,1,2,3", check=True)
    meta = check_against_source(four_layers, out, 1, 4)
    assert [s["units"] for s in meta["layout"]["stages"]] == [
        ["globals", "layer-0000"], ["layer-0001"], ["layer-0002"], ["globals", "layer-0003"]]


def test_shard_pp_errors_are_one_line(checkpoint, tmp_path):
    src = checkpoint("tiny-dsv32")
    from kconvert.convert.shard.job import shard

    with pytest.raises(UsageError, match="--pp 4: the model has 3 decoder layers"):
        shard(shard_job(src, tmp_path / "a", tp=1, pp=4))
    assert_one_line_error(run_cli("shard", src, tmp_path / "b", "--tp", 1, "--pp", 2, "--pp-layers", "0-0,2-2"),
                          "--pp-layers", "layer 1 is in no stage")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # refused before anything is written


def test_pp1_is_todays_layout(checkpoint, converted):
    """pp = 1 writes what the tp-only converter wrote: the tp items unchanged, one stage holding every unit,
    and the rank files of a tp 2 x pp 2 run's first stage byte-identical to the pp = 1 run's."""
    from kconvert.convert.layout import Layout
    from kconvert.quant.policy import QuantPolicy
    from kconvert.convert.shard.pipeline import plan_pipeline
    from kconvert.convert.shard.plan import plan_items
    from kconvert.source.checkpoint import Checkpoint

    src = checkpoint("tiny-k25-dsv32")
    ck = Checkpoint.open(src)
    items = plan_items(ck, Layout.make(2), QuantPolicy("fp8"))
    pipe = plan_pipeline(items, 2, 1, ck.model.text.layer_count)
    assert pipe.items is items and pipe.stage_units == [["globals", "vision", "layer-0000", "layer-0001", "layer-0002"]]
    one, two = converted("tiny-k25-dsv32", 2, 1, "fp8"), converted("tiny-k25-dsv32", 2, 2, "fp8")
    m1, m2 = (read_meta(d) for d in (one, two))
    assert m1["layout"]["pp"] == 1 and m1["layout"]["world_size"] == 2 and len(m1["layout"]["stages"]) == 1
    assert {rec["stage"] for rec in m1["files"].values()} == {0}
    assert m1["layout"]["stages"][0]["units"] == m1["layout"]["units"]
    for rel, rec in m2["files"].items():
        if rec["stage"] == 0 and rec["unit"] != "globals":  # same rank number, same bytes
            assert (two / rel).read_bytes() == (one / rel).read_bytes(), rel
    # every tensor of the pp = 2 run has the CRC of the same tensor of the same tp rank at pp = 1
    crc1 = {(t["rank"], t["name"]): t["crc32"] for t in m1["tensors"]}
    assert all(crc1[(t["rank"] % 2, t["name"])] == t["crc32"] for t in m2["tensors"])
    assert sorted({(t["rank"] % 2, t["name"]) for t in m2["tensors"]}) == sorted(crc1)


# ------------------------------------------------------------------ loader per stage
def test_a_stage_reads_only_its_own_files(converted, tmp_path):
    from kconvert.load.loader import open_converted

    out = converted("tiny-k25-dsv32", 2, 2, "fp8")
    full = json.loads((out / "kconvert.json").read_text())
    for stage in (0, 1):
        lone = tmp_path / f"only-stage-{stage}"
        shutil.copytree(out, lone)
        for other in {0, 1} - {stage}:  # the other stage's files are gone: loading this stage must not notice
            for r in (2 * other, 2 * other + 1):
                shutil.rmtree(lone / f"rank-{r:03d}")
        for tp_rank in (0, 1):
            conv = open_converted(lone, stage=stage, tp_rank=tp_rank, world_size=4)
            assert (conv.rank, conv.stage, conv.tp_rank) == (2 * stage + tp_rank, stage, tp_rank)
            got = dict(conv.stream("cpu", verify=True))
            assert list(got) == full["layout"]["stages"][stage]["units"]
            names = {n for ts in got.values() for n in ts}
            assert ("language_model.lm_head.weight" in names) == (stage == 1)
            assert ("language_model.model.embed_tokens.weight" in names) == (stage == 0)
    with pytest.raises(LoaderError, match=r"stage 2 does not exist: converted for tp 2 x pp 2 \(stages 0..1\)"):
        open_converted(out, stage=2, tp_rank=0)
    with pytest.raises(LoaderError, match=r"ranks 0..3"):
        open_converted(out, rank=4)
    with pytest.raises(LoaderError, match="world size is 2"):
        open_converted(out, rank=0, world_size=2)
    proc = run_cli("load", out, "--stage", 1, "--tp-rank", 1, "--device", "cpu", "--json", check=True)
    report = json.loads(proc.stdout)
    assert (report["rank"], report["stage"], report["tp_rank"], report["files"]) == (3, 1, 1, 2)
    assert_one_line_error(run_cli("load", out, "--stage", 5, "--tp-rank", 0), "kconvert.json", "stages 0..1")


def test_pack_unpack_roundtrip_of_a_pp_conversion(converted, copy_checkpoint):
    from kconvert.convert.pack import pack, unpack
    from kconvert.disk_format.integrity import verify_files
    from kconvert.load.loader import open_converted

    out = copy_checkpoint(converted("tiny-dsv32", 2, 2))
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert pack(out).details.files == 10
    assert verify_files(out)["files"] == 10
    assert len(dict(open_converted(out, stage=1, tp_rank=1).stream("cpu", verify=True))) == 2
    unpack(out)
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_resume_with_another_pp_is_refused(checkpoint, tmp_path):
    from kconvert.convert.shard.job import shard

    src, out = checkpoint("tiny-dsv32"), tmp_path / "out"

    def stop_after_first_file(event, **kw):
        if event == "file":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        shard(shard_job(src, out, tp=1, pp=2, pp_layers="0-0,1-2", workers=1), progress=stop_after_first_file)
    assert not (out / "kconvert.json").exists()
    with pytest.raises(UsageError, match="unfinished conversion with other arguments"):
        shard(shard_job(src, out, tp=1, pp=3))
    # the same pp with another split (here the balanced one, 0-1,2-2) is another conversion too
    with pytest.raises(UsageError, match="unfinished conversion with other arguments"):
        shard(shard_job(src, out, tp=1, pp=2))
    r = shard(shard_job(src, out, tp=1, pp=2, pp_layers="0-0,1-2"))
    assert r.files_resumed >= 1 and r.files_written + r.files_resumed == 5  # 3 layers + globals twice
    assert json.loads((out / "kconvert.json").read_text())["job"]["pp_layers"] == "0-0,1-2"


# ------------------------------------------------------------------ plan
def test_plan_splits_as_shard_does(checkpoint, converted):
    """plan (headers only) and shard (its work items) feed the same split the same bytes."""
    from kconvert.plan.memory import make_plan

    src, out = checkpoint("tiny-k25-dsv32"), converted("tiny-k25-dsv32", 2, 2, "fp8")
    meta = read_meta(out)
    p = make_plan(str(src), 2, quant="fp8", pp=2, context=1024)
    assert p.pipeline["pp_layers"] == meta["job"]["pp_layers"]
    per_rank: dict[int, int] = {}
    for t in meta["tensors"]:
        n = ITEMSIZE[t["dtype"]]
        for d in t["shape"]:
            n *= d
        per_rank[t["rank"]] = per_rank.get(t["rank"], 0) + n
    for f in p.pipeline["stages"]:
        assert f["weights_bytes"] == max(per_rank[2 * f["stage"]], per_rank[2 * f["stage"] + 1])
        assert f["layer_count"] == len([u for u in meta["layout"]["stages"][f["stage"]]["units"] if "layer" in u])


@pytest.mark.parametrize("device", ["H200", "S5000"])
def test_3t_example_fits_with_balanced_stages(device):
    from kconvert.plan.memory import make_plan

    p = make_plan(BIG, 8, quant="fp8", device=device, context=128 * 1024)
    best = p.pp_search["best"]
    assert best is not None and best["fits"] and best["tp"] <= 8  # tensor parallelism inside a node
    assert best["nodes"] == -(-best["tp"] * best["pp"] // 8) and best["pp"] > 1
    assert best["imbalance"] < 0.10
    # planning that layout directly gives the same stages, each fitting, KV only for its own layers
    q = make_plan(BIG, best["tp"], quant="fp8", device=device, context=128 * 1024, pp=best["pp"])
    assert q.pipeline["pp_layers"] == best["pp_layers"] and q.memory["fits"]
    kv = q.kv_cache["bytes_per_token_per_layer"] * 128 * 1024
    assert [s["kv_bytes"] for s in q.pipeline["stages"]] == [kv * s["layer_count"] for s in q.pipeline["stages"]]
    # a smaller layout does not fit: the search's answer is the least number of devices
    assert not any(r["fits"] and r["world_size"] < best["world_size"] for r in p.pp_search["rows"])


def test_plan_pp_cli():
    from kconvert.plan.memory import make_plan

    proc = run_cli("plan", BIG, "--tp", 8, "--pp", 3, "--quant", "fp8", "--context", "128k", check=True)
    assert "--pp-layers 0-20,21-40,41-60" in proc.stdout and "imbalance" in proc.stdout
    assert "smallest tp x pp that fits on H200" in proc.stdout
    with pytest.raises(UsageError, match="names 2 stages but --pp is 3"):
        make_plan(BIG, 8, quant="fp8", pp=3, pp_layers="0-20,21-40")
