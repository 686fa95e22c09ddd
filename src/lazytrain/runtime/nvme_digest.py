"""Integrity digests of the NVMe tier's files: one xxh3-64 digest per write extent.

Owns which bytes of a file were written by which request and their digests, and the check of
bytes read back against them. `runtime/nvme.py` records every write request here and checks
every read; it raises the error (naming the extent) and does the I/O.

Why per extent, not per 4 KiB page: a page digest is a Python call per page (1024 per 4 MiB
request, 0.4-0.9 ms per 4 MiB with the GIL held, on the write and again on the read), one per
extent is one call (0.06-0.08 ms per 4 MiB): `benchmarks/nvme_digest.py`.
"""

from __future__ import annotations

import bisect
import threading
from typing import Callable

import xxhash


class ExtentSums:
    """xxh3-64 digest of every write extent (one write request) of one file, by offset.

    An extent is what one `_write_chunk` wrote: [start, end), at most `chunk_bytes`, hashed in
    one xxh3 call (no Python loop per 4 KiB page: 0.1-0.2 ms per 4 MiB against 0.5-0.9 ms for
    1024 page calls, `benchmarks/nvme_digest.py`). Extents never overlap: a write over part of
    an older extent forgets it (those bytes are then unchecked).
    """

    def __init__(self) -> None:
        self.starts: list[int] = []  # sorted; ends[i] > starts[i], ends[i] <= starts[i + 1]
        self.ends: list[int] = []
        self.digests: list[int] = []
        self.lock = threading.Lock()  # chunks of one file are written by several threads

    def record(self, data: memoryview, offset: int) -> None:
        """Remember the digest of `data`, just written at `offset`."""
        if not len(data):
            return
        digest = xxhash.xxh3_64_intdigest(data)  # hashed outside the lock
        end = offset + len(data)
        with self.lock:
            first = bisect.bisect_right(self.ends, offset)  # first extent ending after offset
            last = bisect.bisect_left(self.starts, end)     # first extent starting at/after end
            self.starts[first:last] = [offset]
            self.ends[first:last] = [end]
            self.digests[first:last] = [digest]

    def overlapping(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """(start, end, digest) of every extent overlapping [start, end), by offset."""
        with self.lock:
            first = bisect.bisect_right(self.ends, start)
            last = bisect.bisect_left(self.starts, end)
            return list(zip(self.starts[first:last], self.ends[first:last],
                            self.digests[first:last]))

    def split(self, start: int, end: int, chunk_bytes: int) -> list[tuple[int, int]]:
        """[start, end) cut at every extent boundary inside it, then into pieces of at most
        `chunk_bytes`: the read requests, so that each whole extent is checked from the
        bytes just read (`damaged_extent`)."""
        cuts = {start, end}
        for a, b, _ in self.overlapping(start, end):
            cuts.update(c for c in (a, b) if start < c < end)
        points = sorted(cuts)
        out = []
        for a, b in zip(points, points[1:]):
            out += [(s, min(s + chunk_bytes, b)) for s in range(a, b, chunk_bytes)]
        return out


def damaged_extent(sums: ExtentSums, chunk: memoryview, offset: int,
                   read_extent: Callable[[int, int], memoryview | None]
                   ) -> tuple[int, int] | None:
    """The first extent whose bytes differ from the ones written, as (start, end), or None.

    `chunk` was just read at file `offset`. An extent inside it is checked from its bytes (one
    xxh3 call); one it covers only in part (a read that ends inside an extent: the store's
    fractional reads) is read again whole with `read_extent(start, end)` (None: the file ends
    early), its digest checked, and the overlap's digests compared (a byte-wise compare of two
    memoryviews costs ~50 ms per 4 MiB). Bytes never written are not checked.
    """
    digest_of = xxhash.xxh3_64_intdigest
    end = offset + len(chunk)
    for a, b, digest in sums.overlapping(offset, end):
        if offset <= a and b <= end:
            ok = digest_of(chunk[a - offset : b - offset]) == digest
        else:
            whole = read_extent(a, b)
            lo, hi = max(a, offset), min(b, end)
            ok = (whole is not None and digest_of(whole) == digest
                  and digest_of(whole[lo - a : hi - a])
                  == digest_of(chunk[lo - offset : hi - offset]))
        if not ok:
            return a, b
    return None
