"""The host buffer pool: reusable 4 KiB-aligned host buffers (pinned on CUDA) for the
activation store's dram and nvme tiers, recycled only after the copies and NVMe requests that
use them completed.

Owns the buffers' life cycle (acquire, release after events and futures, reclaim without
blocking, back-pressure under a byte cap) and the ordering rule that a buffer is handed out
again only after its recorded copies and I/O finished. Knows nothing about boundaries, tiers or
windows: the store (`runtime/activations.py`) says which buffer is free after what.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from lazytrain.runtime.device import Device
from lazytrain.runtime.errors import HostBudgetExceeded


_POOLS: weakref.WeakSet = weakref.WeakSet()
"""Every live pool: the pools of one device (the activation store's and the saved-internals
store's) share its pinned budget, so a refused pin drops the idle buffers of all of them."""


class HostBufferPool:
    """Reusable 4 KiB-aligned host buffers, pinned on CUDA, with an optional byte cap.

    Buffers are recycled by exact size (boundaries of one model have few distinct sizes), so
    steady-state steps allocate nothing. A buffer whose last copies may still run is returned
    with ``release(buffer, after=events, futures=...)``: it waits in a pending list and becomes
    reusable once those copies completed, checked without blocking (``reclaim``); the host
    blocks on them only when ``acquire`` finds no free buffer of the size but a pending one
    (back-pressure instead of allocating past the plan's pinned bytes). So handing a buffer
    back never synchronises the host with the device. A buffer whose NVMe requests never
    finish (``wait_io`` raised, e.g. a stuck drive) is abandoned, never handed out again: the
    request may still read or write it.

    Args:
        device: the device API; buffers come from its ``pinned_empty``.
        capacity_bytes: cap on allocated bytes (in use + pending + cached); None = unbounded.
        wait_io: ``wait_io(futures, owner)`` blocks until a buffer's NVMe futures finished
            (their errors are not its to raise) or raises where they will not (the store's:
            NvmeTimeoutError after ``runtime.nvme_timeout_s``); ``owner`` is what ``release``
            got. Default: wait as long as it takes.
        owner: the ledger owner of its buffers (the saved-internals store has its own).
    """

    def __init__(self, *, device: Device, capacity_bytes: int | None = None,
                 wait_io: Callable[[list, object], None] | None = None,
                 owner: str = "checkpoint host buffer") -> None:
        self.device = device
        self.owner = owner
        self.capacity_bytes = capacity_bytes
        self.allocated_bytes = 0  # abandoned buffers stay counted: their memory is still used
        self._wait_io = wait_io or (lambda futures, owner: device.wait_futures(futures))
        self._free: dict[int, list[torch.Tensor]] = {}
        self._pending: list[tuple] = []  # (buffer, events, futures, owner)
        _POOLS.add(self)

    def acquire(self, nbytes: int) -> torch.Tensor:
        """An aligned ``uint8`` buffer [nbytes] (contents undefined).

        A buffer of a new size is pinned through the device API; where that would pass the
        ledger's pinned budget, every idle buffer (free, or pending once its copies finished)
        of every pool on the device is dropped first and the pin is tried once more.

        Raises:
            MemoryError: allocating would exceed ``capacity_bytes`` even after waiting for every
                pending buffer and dropping every cached one.
            HostBudgetExceeded: the pin passes the ledger's pinned budget even without the
                pool's idle buffers.
            NvmeTimeoutError (from ``wait_io``): the pending buffer it waited for is held by
                NVMe requests that do not finish (the buffer is abandoned).
        """
        self.reclaim()
        cached = self._free.get(nbytes)
        if cached:
            return cached.pop()
        same_size = [item for item in self._pending if item[0].numel() == nbytes]
        if same_size:  # the host ran ahead of the copies: wait for the oldest, do not grow
            self._pending.remove(same_size[0])
            self._recycle(*same_size[0])
            return self._free[nbytes].pop()
        if self.capacity_bytes is not None and self.allocated_bytes + nbytes > self.capacity_bytes:
            self.reclaim(block=True)
            self._drop_cached()
            if self.allocated_bytes + nbytes > self.capacity_bytes:
                raise MemoryError(
                    f"host buffer pool: {nbytes} more bytes would exceed its cap of "
                    f"{self.capacity_bytes} bytes ({self.allocated_bytes} in use)"
                )
        name = f"{self.owner} of {nbytes} bytes"
        try:
            buffer = self.device.pinned_empty(nbytes, name=name)
        except HostBudgetExceeded:
            # idle buffers of sizes an earlier micro-batch asked for (GRPO cuts its rows to
            # their longest, so its sizes change from micro-batch to micro-batch), in this pool
            # or another on the device (one pinned budget), must not fail a request that fits
            # without them: drop them after their copies, retry once
            pools = [p for p in list(_POOLS) if p.device is self.device]
            if not any(p._free or p._pending for p in pools):
                raise
            for pool in pools:
                pool.reclaim(block=True)
                pool._drop_cached()
            buffer = self.device.pinned_empty(nbytes, name=name)
        self.allocated_bytes += nbytes  # after: a refused pin (HostBudgetExceeded) adds nothing
        return buffer

    def has(self, nbytes: int) -> bool:
        """Whether `acquire(nbytes)` can hand out a buffer it already holds (free or pending)."""
        return bool(self._free.get(nbytes)) or any(item[0].numel() == nbytes
                                                   for item in self._pending)

    def release(self, buffer: torch.Tensor, *, after=(), futures=(), owner=None) -> None:
        """Return a buffer, reusable once the copy events ``after`` completed and the NVMe
        ``futures`` finished (their errors are the issuer's to report; ``owner`` names the
        buffer's last user to ``wait_io``). The caller guarantees no other copy reads or writes
        it (the device API checks it on cpu-checked and poisons the buffer on cpu-threaded)."""
        self._pending.append((buffer, [e for e in after if e is not None], list(futures), owner))
        self.reclaim()

    def reclaim(self, *, block: bool = False) -> None:
        """Make pending buffers whose copies completed reusable; ``block``: wait for all.

        Raises:
            NvmeTimeoutError (from ``wait_io``, only with ``block``): some pending buffer's NVMe
                requests do not finish; every other pending buffer was reclaimed first.
        """
        still, stuck = [], None
        for item in self._pending:
            _, events, futures, _ = item
            if block or (all(self.device.query(e) for e in events)
                         and all(f.done() for f in futures)):
                try:
                    self._recycle(*item)
                except Exception as exc:  # abandoned; the others are still reclaimed
                    stuck = stuck or exc
            else:
                still.append(item)
        self._pending = still
        if stuck is not None:
            raise stuck

    def _recycle(self, buffer: torch.Tensor, events: list, futures: list, owner) -> None:
        """Wait for the buffer's copies and NVMe requests, then make it reusable; a ``wait_io``
        error leaves it abandoned (dropped from the pool) and propagates."""
        for event in events:
            self.device.host_wait(event)  # returns at once when query() said done; orders it
        self._wait_io(futures, owner)
        self.device.recycle(buffer)
        self._free.setdefault(buffer.numel(), []).append(buffer)

    def drop_cached(self) -> None:
        """Forget every free buffer (pending ones stay): their pinned memory goes back once
        nothing else holds them, e.g. buffers of sizes the caller no longer asks for."""
        self._drop_cached()

    def _drop_cached(self) -> None:
        for size, buffers in self._free.items():
            self.allocated_bytes -= size * len(buffers)
        self._free.clear()
