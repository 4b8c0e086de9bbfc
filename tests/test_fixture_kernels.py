"""The trained presets train with ATen's AVX2 kernels wherever the CPU has them (kconvert/fixtures/kernels.py): on an
AVX-512 machine ATen's own choice rounds differently, and the trained drafter of tiny-dsv4-dspark-trained drafted 16 %
of the target's tokens there against 31 % (the floor tests/test_dspark_trained.py holds it to). The pin is set only
before torch is imported, never over the user's own ATEN_CPU_CAPABILITY, and only on a CPU that runs AVX2."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers import ROOT
from kconvert.fixtures import kernels

AVX2 = {"avx2", "fma"} <= kernels._cpu_flags()


def _kernels_after(code: str, **env) -> str:
    """The kernels a fresh process's torch dispatches to after `code` ran, with ATEN_CPU_CAPABILITY as `env` says."""
    clean = {k: v for k, v in os.environ.items() if k != kernels.VARIABLE}
    r = subprocess.run([sys.executable, "-c", f"{code}\nfrom kconvert.fixtures import kernels\nprint(kernels.in_use())"],
                       capture_output=True, text=True, cwd=ROOT, env={**clean, **env}, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()[-1]


def test_the_pin_decides_the_kernels_only_before_torch_and_never_over_the_user():
    natural = _kernels_after("import torch")
    pinned = _kernels_after("from kconvert.fixtures import kernels; kernels.pin()")
    assert pinned == ("AVX2" if AVX2 else natural)
    assert _kernels_after("import torch\nfrom kconvert.fixtures import kernels; kernels.pin()") == natural
    assert _kernels_after("from kconvert.fixtures import kernels; kernels.pin()", ATEN_CPU_CAPABILITY="default") \
        == "DEFAULT"


@pytest.mark.skipif(not AVX2, reason="a CPU without AVX2: nothing is pinned")
def test_this_suite_trains_with_the_pinned_kernels():
    assert kernels.in_use() == "AVX2"  # conftest pinned them before torch was imported
