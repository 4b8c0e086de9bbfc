"""What the first-load CRC-32 check costs (kconvert/load/first_load.py): one file read from the page cache,
side by side with the same read plus a CRC-32 over it, zlib's and kconvert's (kconvert/io/crc.py: ISA-L's where
`isal` is installed, the same checksum), as the loader does with verify.

    .venv/bin/python bench/crc_cost.py --size 512       # MiB; prints GiB/s of each and their time ratio
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import zlib

import _cli  # first: importing it puts this tree's kconvert first on sys.path

del _cli


def best(fn, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=512, help="MiB")
    a = ap.parse_args()
    with tempfile.NamedTemporaryFile(dir=os.environ.get("TMPDIR")) as f:
        f.write(os.urandom(a.size << 20))
        f.flush()
        read = lambda: open(f.name, "rb").read()  # noqa: E731
        read()  # into the page cache
        r = best(read)
        rc = best(lambda: zlib.crc32(read()))
        from kconvert.io.crc import crc32

        rk = best(lambda: crc32(read()))
    gib = a.size / 1024
    print(f"read {gib / r:.2f} GiB/s | read + zlib.crc32 {gib / rc:.2f} GiB/s (x{rc / r:.2f} the read) | read + "
          f"kconvert's crc32 ({crc32.__module__}) {gib / rk:.2f} GiB/s (x{rk / r:.2f}); later loads x1.00")


if __name__ == "__main__":
    main()
