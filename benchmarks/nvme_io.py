"""NVMe-tier throughput of the checkpoint store vs a plain ``dd``-style copy of the same bytes.

Run:  python benchmarks/nvme_io.py --nvme-dir /path/on/nvme [--nbytes-mb 256] [--io-threads 2]

Prints one table: write and read GB/s of the store's path (ActivationStore nvme_write /
nvme_read, timed from issue to the window barrier) and of the baseline, and the ratio store /
baseline (the engine issue's goal: >= 0.8). Not part of CI; ``measure_nvme_path`` is the entry
point the engine benchmark and the profiler call.

Baseline ("dd bs=4M conv=fsync" then "dd bs=4M iflag=direct"): ``os.write`` of the same bytes
in 4 MiB chunks followed by ``fsync``, then a read back in 4 MiB chunks with O_DIRECT.

How the page cache is kept out of the numbers:
- store, O_DIRECT (the default wherever the filesystem allows it): no page cache involved.
- store, buffered fallback: the timed write includes an ``fsync`` of the file, and before the
  read the file is dropped from the cache with ``posix_fadvise(POSIX_FADV_DONTNEED)``.
- baseline: the write includes ``fsync``; the read uses O_DIRECT, or, where the filesystem
  refuses it, ``posix_fadvise(DONTNEED)`` after the fsync and a buffered read.
On tmpfs all of this is RAM bandwidth (the store warns).

Integrity cost (second table): the store's round trip with the xxh3-64 extent digests that
``NvmeIO`` computes on every write and checks on every read, against the same round trip with
the two digest calls replaced by no-ops inside this benchmark only (the runtime has no switch to
turn them off), and the digest rate of one thread alone (GB/s over write requests). Ratios
(checked / unchecked) are what to compare across machines.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import contextlib

import torch

from lazytrain.contract import align_up
from lazytrain.runtime import nvme
from lazytrain.runtime.activations import ActivationStore
from lazytrain.runtime.filesystem import filesystem_type
from lazytrain.runtime.nvme import CHUNK_BYTES, aligned_empty, supports_o_direct
from lazytrain.runtime.nvme_digest import ExtentSums
from lazytrain.units import GB


def _drop_from_page_cache(path: Path) -> None:
    """fsync the file and ask the kernel to drop its cached pages (best effort on Linux)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _store_round_trip(nvme_dir: Path, data: torch.Tensor, *, io_threads: int, direct: bool,
                      chunk_bytes: int) -> tuple[float, float]:
    """Seconds for the store's nvme_write and nvme_read of ``data`` (each up to its barrier)."""
    with ActivationStore(device=torch.device("cpu"), nvme_dir=nvme_dir, io_threads=io_threads,
                         direct=direct, chunk_bytes=chunk_bytes) as store:
        store.begin_window("f0")
        store.put(0, data, "nvme")
        store.transfer(0, "d2h", 1.0)  # host staging copy; not timed
        store.end_window()
        path = store.io.path_for((0, 0))

        store.begin_window("f1")
        t0 = time.perf_counter()
        store.transfer(0, "nvme_write", 1.0)
        store.end_window()  # barrier: every chunk written
        if not direct:
            _drop_from_page_cache(path)  # the fsync belongs to the timed write in buffered mode
        write_s = time.perf_counter() - t0

        store.begin_window("b1")
        t0 = time.perf_counter()
        store.transfer(0, "nvme_read", 1.0)
        store.end_window()
        read_s = time.perf_counter() - t0
    return write_s, read_s


def _dd_round_trip(nvme_dir: Path, data: torch.Tensor, *, direct_read: bool) -> tuple[float, float]:
    """Seconds for a plain chunked write + fsync and a chunked read back of the same bytes."""
    path = nvme_dir / "dd_baseline.bin"
    view = memoryview(data.numpy())
    nbytes = len(view)
    try:
        t0 = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for start in range(0, nbytes, CHUNK_BYTES):
                os.write(fd, view[start : start + CHUNK_BYTES])
            os.fsync(fd)
        finally:
            os.close(fd)
        write_s = time.perf_counter() - t0

        if not direct_read:
            _drop_from_page_cache(path)
        buf = aligned_empty(align_up(nbytes))
        out = memoryview(buf.numpy())
        flags = os.O_RDONLY | (os.O_DIRECT if direct_read else 0)
        t0 = time.perf_counter()
        fd = os.open(path, flags)
        try:
            got = 0
            while got < nbytes:
                n = os.preadv(fd, [out[got : got + CHUNK_BYTES]], got)
                if n == 0:
                    break
                got += n
        finally:
            os.close(fd)
        read_s = time.perf_counter() - t0
        if got != nbytes:
            raise OSError(f"baseline read {got} of {nbytes} bytes from {path}")
    finally:
        path.unlink(missing_ok=True)
    return write_s, read_s


def measure_nvme_path(
    nvme_dir: Path | str,
    nbytes: int,
    *,
    io_threads: int = 2,
    direct: bool | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    repeats: int = 2,
) -> dict:
    """Write/read throughput of the store's NVMe path and of a dd-style copy, in one run.

    Args:
        nvme_dir: directory to measure (created if missing); files are removed afterwards.
        nbytes: bytes per transfer (a few hundred MB gives stable numbers).
        io_threads: the store's NVMe worker threads.
        direct: O_DIRECT policy of the store (None: probe, as the engine does).
        chunk_bytes: the store's request size (bytes).
        repeats: runs per path; the best (fastest) of each is reported.

    Returns:
        dict with nbytes, filesystem, direct, io_threads, chunk_bytes, and GB/s (1e9 B/s):
        store_write_gb_per_s, store_read_gb_per_s, dd_write_gb_per_s, dd_read_gb_per_s,
        write_ratio, read_ratio (store / dd).
    """
    nvme_dir = Path(nvme_dir)
    nvme_dir.mkdir(parents=True, exist_ok=True)
    use_direct = supports_o_direct(nvme_dir) if direct is None else direct
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    store_runs = [_store_round_trip(nvme_dir, data, io_threads=io_threads, direct=use_direct,
                                    chunk_bytes=chunk_bytes) for _ in range(repeats)]
    dd_runs = [_dd_round_trip(nvme_dir, data, direct_read=supports_o_direct(nvme_dir))
               for _ in range(repeats)]
    result = {
        "nbytes": nbytes,
        "filesystem": filesystem_type(nvme_dir),
        "direct": use_direct,
        "io_threads": io_threads,
        "chunk_bytes": chunk_bytes,
        "store_write_gb_per_s": nbytes / min(w for w, _ in store_runs) / GB,
        "store_read_gb_per_s": nbytes / min(r for _, r in store_runs) / GB,
        "dd_write_gb_per_s": nbytes / min(w for w, _ in dd_runs) / GB,
        "dd_read_gb_per_s": nbytes / min(r for _, r in dd_runs) / GB,
    }
    result["write_ratio"] = result["store_write_gb_per_s"] / result["dd_write_gb_per_s"]
    result["read_ratio"] = result["store_read_gb_per_s"] / result["dd_read_gb_per_s"]
    return result


@contextlib.contextmanager
def _digests_off():
    """The store without extent digests (benchmark only): record and check become no-ops."""
    record, check = ExtentSums.record, nvme.NvmeIO._check
    ExtentSums.record = lambda self, data, offset: None
    nvme.NvmeIO._check = lambda self, key, fd, chunk, offset, sums: None
    try:
        yield
    finally:
        ExtentSums.record, nvme.NvmeIO._check = record, check


def measure_checksum_cost(nvme_dir: Path | str, nbytes: int, *, io_threads: int = 2,
                          direct: bool | None = None, chunk_bytes: int = CHUNK_BYTES,
                          repeats: int = 3) -> dict:
    """The store's NVMe round trip with and without the extent digests, in one run.

    Returns:
        dict with GB/s (1e9 B/s) checked_write/read, unchecked_write/read, digest_gb_per_s (one
        thread hashing write requests in memory) and write_ratio / read_ratio (checked /
        unchecked: 1.0 = free).
    """
    nvme_dir = Path(nvme_dir)
    nvme_dir.mkdir(parents=True, exist_ok=True)
    use_direct = supports_o_direct(nvme_dir) if direct is None else direct
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    kw = dict(io_threads=io_threads, direct=use_direct, chunk_bytes=chunk_bytes)
    checked, unchecked = [], []
    for _ in range(repeats):  # interleaved, so drift of the drive affects both alike
        checked.append(_store_round_trip(nvme_dir, data, **kw))
        with _digests_off():
            unchecked.append(_store_round_trip(nvme_dir, data, **kw))
    view = memoryview(data.numpy())
    t0 = time.perf_counter()
    for start in range(0, nbytes, chunk_bytes):  # one digest per write request
        ExtentSums().record(view[start:start + chunk_bytes], start)
    digest_s = time.perf_counter() - t0
    out = {"nbytes": nbytes, "direct": use_direct, "io_threads": io_threads,
           "digest_gb_per_s": nbytes / digest_s / GB}
    for name, runs in (("checked", checked), ("unchecked", unchecked)):
        out[f"{name}_write_gb_per_s"] = nbytes / min(w for w, _ in runs) / GB
        out[f"{name}_read_gb_per_s"] = nbytes / min(r for _, r in runs) / GB
    for d in ("write", "read"):
        out[f"{d}_ratio"] = out[f"checked_{d}_gb_per_s"] / out[f"unchecked_{d}_gb_per_s"]
    return out


def format_checksum_table(result: dict) -> str:
    """The integrity-cost table: checked vs unchecked GB/s per direction and the ratio."""
    rows = [f"extent digests (xxh3-64 per request; one thread hashes {result['digest_gb_per_s']:.2f}"
            f" GB/s)",
            f"{'direction':<10}{'checked':>10}{'unchecked':>11}{'ratio':>8}"]
    for d in ("write", "read"):
        rows.append(f"{d:<10}{result[f'checked_{d}_gb_per_s']:>10.2f}"
                    f"{result[f'unchecked_{d}_gb_per_s']:>11.2f}{result[f'{d}_ratio']:>8.2f}")
    return "\n".join(rows)


def format_table(result: dict) -> str:
    """The benchmark's table: one row per direction, store vs dd GB/s and the ratio."""
    head = (f"NVMe path, {result['nbytes'] / 1e6:.0f} MB on {result['filesystem']}, store "
            f"{'O_DIRECT' if result['direct'] else 'buffered'}, {result['io_threads']} threads, "
            f"{result['chunk_bytes'] >> 20} MiB requests")
    rows = [f"{'direction':<10}{'store GB/s':>12}{'dd GB/s':>10}{'ratio':>8}"]
    for direction in ("write", "read"):
        rows.append(f"{direction:<10}{result[f'store_{direction}_gb_per_s']:>12.2f}"
                    f"{result[f'dd_{direction}_gb_per_s']:>10.2f}{result[f'{direction}_ratio']:>8.2f}")
    return "\n".join([head, *rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nvme-dir", type=Path, default=None,
                        help="directory on the drive to measure (default: a temp dir under the cwd)")
    parser.add_argument("--nbytes-mb", type=int, default=256, help="MB (1e6 B) per transfer")
    parser.add_argument("--io-threads", type=int, default=2)
    parser.add_argument("--buffered", action="store_true", help="force the store's buffered I/O")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.nvme_dir or Path.cwd(), prefix="nvme-bench-") as tmp:
        result = measure_nvme_path(tmp, args.nbytes_mb * 1_000_000, io_threads=args.io_threads,
                                   direct=False if args.buffered else None, repeats=args.repeats)
        cost = measure_checksum_cost(tmp, args.nbytes_mb * 1_000_000,
                                     io_threads=args.io_threads,
                                     direct=False if args.buffered else None,
                                     repeats=max(args.repeats, 3))
    print(format_table(result))
    print(format_checksum_table(cost))
    return 0


if __name__ == "__main__":
    sys.exit(main())
