"""Issue 42, classes 7 and 8: the newest options and inputs, typed as a hostile user would. Each is one line,
exit 2, before any work, where they used to be accepted (non-ASCII digits: '٣' read as 3) or end in an internal
error (exit 3: a 10^12-token calibration allocating, a 10^23 seed overflowing the generator)."""

from __future__ import annotations

import shutil

import pytest

from helpers import assert_one_line_error, cli_here


@pytest.mark.parametrize("option, value, needle", [
    ("--calibration-tokens", "٣٣", "ASCII digits"),
    ("--calibration-tokens", "1000000000000", "at most 16777216"),
    ("--calibration-seq", "١٢٨", "ASCII digits"),
    ("--calibration-seq", "1", "at least 2"),
    ("--calibration-seed", "100000000000000000000000", "out of range"),
    ("--calibration-seed", "-1", "at least 0"),
])
def test_calibration_numbers(checkpoint, tmp_path, option, value, needle):
    out = tmp_path / "out"
    p = cli_here("shard", checkpoint("tiny-k25-dsv32"), out, "--tp", "1", "--quant", "int4", "--calibrate", "stdlib",
                 option, value)
    assert_one_line_error(p, option, needle)
    assert not out.exists()


@pytest.mark.parametrize("level", ["٣", "99999999999999999999999", "3.0"])
def test_compress_level_in_ascii_digits(conversion, tmp_path, level):
    out = tmp_path / "c"  # a copy: a level read as 3 would pack it
    shutil.copytree(conversion("tiny-k25-dsv32", tp=2, quant="fp8"), out)
    assert_one_line_error(cli_here("pack", out, "--compress", f"zstd:{level}"), "zstd:LEVEL")
    assert not (out / ".kconvert").exists()
