"""Released checkpoints hold 70k-210k tensors: nothing per tensor may grow with the tensor count.

The topology presets (kconvert/fixtures/models/topology.py) give a release's tensor layout at tiny widths; here a
few hundred to a few thousand tensors, in process. Doubling the decoder layers doubles the tensors and the
files; inspect + shard + verify-files + loading a rank must then cost about twice as much CPU, not four
times (a loose bound, < 3x, that a loaded machine does not trip: CPU time of this process, not wall time).
"""

from __future__ import annotations

import time

import pytest

from kconvert.disk_format.catalog import Catalog
from kconvert.disk_format.integrity import verify_files
from helpers import shard_job
from kconvert.convert.shard.job import shard
from kconvert.load.loader import open_converted
from kconvert.inspect.checkpoint import summarize
from kconvert.source.checkpoint import Checkpoint

SCALED = [("topo-k25", 96), ("topo-kimi-k3", 48)]  # INT4 triples; Kimi K3's MXFP4 pairs (the columnar path)


def _metadata_work(src, out) -> tuple[float, int]:
    """(CPU seconds, stored tensors) of inspect, shard --tp 2, verify-files and loading rank 1."""
    t = time.process_time()
    stored = summarize(Checkpoint.open(src)).tensors
    shard(shard_job(src, out, tp=2))
    verify_files(out)
    for _ in open_converted(out, rank=1).stream("cpu", prefetch=1):
        pass
    return time.process_time() - t, stored


@pytest.mark.parametrize("preset,experts", SCALED, ids=[p for p, _ in SCALED])
def test_doubling_the_tensor_count_at_most_about_doubles_the_metadata_cost(checkpoint, tmp_path, preset, experts):
    small = checkpoint(preset, layers=3, experts=experts)  # 2 MoE layers
    large = checkpoint(preset, layers=5, experts=experts)  # 4 MoE layers: twice the tensors and files
    _metadata_work(small, tmp_path / "warm")  # imports and first calls out of the way
    t_small, n_small = _metadata_work(small, tmp_path / "small")
    t_large, n_large = _metadata_work(large, tmp_path / "large")
    assert 1.8 < n_large / n_small < 2.2
    assert t_large / t_small < 3, f"{n_small} tensors: {t_small:.2f} s CPU; {n_large}: {t_large:.2f} s"


def test_topology_overrides_build_valid_checkpoints(checkpoint):
    """--layers / --experts: a smaller checkpoint of the same kind, valid against its family manifest, stored
    as the release stores it (INT4 experts; V4's FP8 + FP4 sidecars); other presets refuse the overrides."""
    from kconvert.errors import UsageError
    from kconvert.fixtures import build_fixture

    k25 = summarize(Checkpoint.open(checkpoint("topo-k25", layers=3, experts=8)))
    assert (k25.model["layers"], k25.model["routed_experts"]) == (3, 8)
    assert {r["format"]: r["tensors"] for r in k25.formats}["int4_packed"] == 2 * 8 * 3  # 2 MoE layers
    bf16 = summarize(Checkpoint.open(checkpoint("topo-k25-bf16", layers=3, experts=8)))  # the same weights, as is
    assert {r["format"] for r in bf16.formats} == {"plain"} and bf16.tensors == k25.tensors
    assert bf16.quantization is None and k25.quantization is not None
    v4 = summarize(Checkpoint.open(checkpoint("topo-dsv4-pro", layers=3, experts=8)))
    formats = {r["format"]: r["tensors"] for r in v4.formats}
    assert (v4.model["layers"], v4.model["mtp_layers"]) == (3, 1) and formats["fp4_packed"] == 4 * 8 * 3
    assert formats["block_fp8"] > 0
    with pytest.raises(UsageError, match="topology presets"):
        build_fixture("tiny-k25-dsv32", "/nonexistent/x", layers=3)
    with pytest.raises(UsageError, match="topology presets"):  # widen: the same formats, larger tensors
        build_fixture("tiny-k25-dsv32", "/nonexistent/x", widen=2)


def test_widened_topology_keeps_its_formats(tmp_path):
    """bench/metadata_bench.py's data-time checkpoint: the preset's stored formats at `widen` x its widths."""
    from kconvert.fixtures import build_fixture

    base, wide = (summarize(Checkpoint.open(build_fixture("topo-k25", tmp_path / f"w{w}", layers=2, experts=2,
                                                          widen=w))) for w in (1, 4))
    assert wide.model["hidden_size"] == 4 * base.model["hidden_size"]
    assert [(r["format"], r["tensors"]) for r in wide.formats] == [(r["format"], r["tensors"]) for r in base.formats]


def test_a_rank_reads_only_its_own_tensor_list(checkpoint, tmp_path):
    """kconvert.json (format 4) lists no tensors; each rank's list is its own file, checked against the
    sha256 kconvert.json records: loading rank 1 works with every other rank's list gone."""
    out = tmp_path / "tp2"
    shard(shard_job(checkpoint("topo-k25", layers=3, experts=8), out, tp=2))
    cat = Catalog.read(out)
    assert "tensors" not in cat.doc and len(cat.doc["tensors_by_rank"]) == 2
    everyone = cat.tensors
    (out / "rank-000" / "tensors.json").unlink()
    conv = open_converted(out, rank=1)
    held = dict(conv.stream("cpu"))
    assert [t for t in everyone if t["rank"] == 1] == conv.catalog.rank_tensors(1)
    assert sum(len(u) for u in held.values()) == cat.doc["tensors_by_rank"][1]["tensors"]
    with pytest.raises(Exception, match="rank 0's tensor list"):
        verify_files(out)


def test_inspect_and_plan_read_headers_without_importing_torch(checkpoint):
    """inspect and plan (of a checkpoint, a converted directory and a preset) read headers and config only:
    torch's import (~1.5 s, more than the headers of a 200k-tensor release) is not paid. The static byte
    sizes they use instead of torch's agree with torch."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    import torch

    from kconvert.io.dtypes import DTYPES, ITEMSIZE

    assert {t: torch.empty(0, dtype=d).element_size() for t, d in DTYPES.items()} == ITEMSIZE
    src = checkpoint("topo-k25", layers=3, experts=96)
    code = f"""
import contextlib, io, json, sys
from cli.main import main
seen = {{}}
for args in (["inspect", {str(src)!r}], ["plan", {str(src)!r}, "--tp", "2", "--quant", "fp8"],
             ["plan", "k25-dsv32-3t", "--tp", "8", "--quant", "int4", "--device", "H200"]):
    with contextlib.redirect_stdout(io.StringIO()):
        seen[args[0] + str(len(args))] = main(args)
seen["heavy"] = [m for m in ("torch", "numpy", "safetensors", "transformers") if m in sys.modules]
print(json.dumps(seen))
"""
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120,
                       env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout)
    assert seen.pop("heavy") == [] and set(seen.values()) == {0}, seen
