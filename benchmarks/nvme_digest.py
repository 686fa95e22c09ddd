"""NVMe integrity digests: the old per-4 KiB-page loop vs one digest per write extent.

Run:  python benchmarks/nvme_digest.py [--mib 4] [--repeats 20]

Prints ms per 4 MiB (median of the repeats, one thread, data in DRAM; no drive involved):

- page loop (before): 1024 `xxh3_64_intdigest` calls, one per 4 KiB page, gathered by
  `np.fromiter` (what `NvmeIO` did on every write and again on every read);
- extent (now): `ExtentSums.record` of one 4 MiB write request (one xxh3 call) and the check
  of a read that covers the extent whole (`NvmeIO._check`: one call and a lookup);
- partial extent (now, the rare case): the check of a read ending inside the extent, which
  reads the whole extent again from the file (page cache here) and compares the overlap.

Not part of CI; numbers from a loaded shared machine vary, the ratio is what to compare.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np
import torch
import xxhash

from lazytrain.runtime.nvme import NvmeIO, aligned_empty
from lazytrain.runtime.nvme_digest import ExtentSums

MIB = 1 << 20
PAGE = 4096


def page_loop(data: memoryview) -> np.ndarray:
    """The digests as `NvmeIO` computed them before: one xxh3-64 call per 4 KiB page."""
    digest = xxhash.xxh3_64_intdigest
    return np.fromiter((digest(data[a:a + PAGE]) for a in range(0, len(data), PAGE)),
                       dtype=np.uint64)


def median_ms(fn, repeats: int) -> float:
    """Median wall time of `fn()` over `repeats` runs after one warm-up, ms."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure(nbytes: int, repeats: int) -> dict:
    """ms per call of each digest path on `nbytes` random bytes (see the module docstring)."""
    buf = aligned_empty(nbytes)
    buf.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8,
                            generator=torch.Generator().manual_seed(0)))
    view = memoryview(buf.numpy())
    sums = ExtentSums()
    out = {"nbytes": nbytes, "page_loop_ms": median_ms(lambda: page_loop(view), repeats),
           "extent_write_ms": median_ms(lambda: sums.record(view, 0), repeats)}
    with tempfile.TemporaryDirectory(prefix="nvme-digest-") as tmp:
        io = NvmeIO(tmp, chunk_bytes=nbytes, direct=False)
        try:
            io.wait(io.write((0, 0), buf, 0))
            io.finish_write((0, 0))
            fd = io._open((0, 0), "open_read", 0)
            extent = io._sums[(0, 0)]
            out["extent_read_ms"] = median_ms(lambda: io._check((0, 0), fd, view, 0, extent),
                                              repeats)
            half = view[: nbytes // 2]
            out["partial_read_ms"] = median_ms(lambda: io._check((0, 0), fd, half, 0, extent),
                                               repeats)
        finally:
            io.close()
    return out


def format_table(r: dict) -> str:
    """Old vs new, ms per call and per 4 MiB."""
    per = 4 * MIB / r["nbytes"]
    rows = [f"NVMe digests, {r['nbytes'] / MIB:g} MiB in DRAM, one thread (ms per 4 MiB)",
            f"{'path':<34}{'ms':>8}",
            f"{'page loop, write or read (before)':<34}{r['page_loop_ms'] * per:>8.3f}",
            f"{'extent, write (now)':<34}{r['extent_write_ms'] * per:>8.3f}",
            f"{'extent, read whole (now)':<34}{r['extent_read_ms'] * per:>8.3f}",
            f"{'extent, read in part (now, rare)':<34}{r['partial_read_ms'] * per:>8.3f}",
            f"speed-up per write+read: {2 * r['page_loop_ms'] / (r['extent_write_ms'] + r['extent_read_ms']):.1f}x"]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=4, help="MiB per extent (the request size)")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    print(format_table(measure(args.mib * MIB, args.repeats)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
