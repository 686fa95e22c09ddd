"""The activation store: where each block-boundary activation lives during one training step.

Owns the boundary tensors of the tiers hbm, dram, nvme and recompute (the segment's recompute
cache, held in HBM), the byte ranges moved by each plan transfer (d2h, nvme_write, nvme_read,
h2d), the window barrier that releases drained HBM copies, and the byte accounting per tier
(current and peak per window) that the runtime contract checks against the plan's
``hbm_checkpoint_bytes``. It does not decide anything: the engine calls ``put``/``transfer``/
``get``/``release`` exactly as the Plan says (docs/execution_model.md). It knows nothing about
blocks, weights or autograd, and nothing about files beyond ``runtime/nvme.py``'s interface.

Device path: every copy, wait and allocation goes through the device API
(``runtime/device.py``), one path for every backend: host buffers come from ``pinned_empty``
(page-locked on CUDA) through a bounded pool (``runtime/host_pool.py``); d2h and h2d run on
the streams "ckpt_d2h" and "ckpt_h2d" (separate from the weight and gradient streams, so a
window barrier never waits for the next block's weight prefetch), ordered by events. On the CPU backends the hbm tier is
device memory under a byte budget and the dram tier separate host tensors.

Accounting keys (bytes): ``hbm`` (hbm-tier and recompute-cache tensors, offloaded boundaries
until their HBM copy is released, prefetched device buffers from the first h2d fraction on; this
is the quantity the plan's ``hbm_checkpoint_bytes`` bounds), ``dram`` (host copies of dram-tier
boundaries, logical size), ``dram_staging`` (host bounce buffers of nvme-tier boundaries,
padded to 4 KiB), ``nvme`` (file sizes, padded to 4 KiB).
"""

from __future__ import annotations

import atexit
from collections.abc import Callable
from pathlib import Path

import torch

from lazytrain.contract import TRANSFER_ORDER, align_up
from lazytrain.planner.windows import TIERS, TRANSFER_KINDS
from lazytrain.runtime.backends import as_device
from lazytrain.runtime.boundary_entry import BoundaryEntry
from lazytrain.runtime.device import Device
from lazytrain.runtime.errors import (
    CheckpointNotResidentError,
    HbmBudgetExceeded,
    NvmeIOError,
    TransferOrderError,
    boundary_label,
)
from lazytrain.runtime.host_pool import HostBufferPool
from lazytrain.runtime.nvme import IoEvent, Key, NvmeIO, NvmeTimeoutError, align_down

STORE_TIERS = TIERS
"""Tier vocabulary of Plan JSON v1."""

# The engine issues a window's transfers in `lazytrain.contract.TRANSFER_ORDER`: a kind reads
# the bytes the previous kind delivered, and the plan allows both in the same window.
assert sorted(TRANSFER_ORDER) == sorted(TRANSFER_KINDS)

ACCOUNTING_KEYS = ("hbm", "dram", "dram_staging", "nvme")

_KINDS_BY_TIER = {"hbm": (), "recompute": (), "dram": ("d2h", "h2d"), "nvme": TRANSFER_ORDER}

_FRACTION_TOL = 1e-6
"""Cumulative fractions within this of 1 count as complete (plans store floats)."""


class ActivationStore:
    """Boundary activations in the tiers hbm / dram / nvme / recompute, moved as the plan says.

    Call protocol per window (docs/execution_model.md): ``begin_window(name)``; ``put`` the
    boundaries whose holding interval starts here; ``transfer`` every plan transfer of the window
    in TRANSFER_ORDER; ``get`` the boundaries the window consumes; ``release`` those whose holding
    interval ends here; ``end_window()``. ``put`` outside a window counts from the next one.

    Args:
        device: the device API (``runtime/device.py``), or a backend name / torch.device
            ("cpu", "cuda", "cpu-checked", ...); the engine passes its own.
        nvme_dir: directory for the nvme tier's files (created if missing; warns on tmpfs).
        io_threads: NVMe worker threads.
        hbm_limits: window name -> the plan's ``hbm_checkpoint_bytes``; every put/transfer and
            window start checks the held HBM bytes against it (HbmBudgetExceeded).
        fault_hook: passed to NvmeIO (tests: a ``FaultInjector``).
        direct: O_DIRECT policy for NvmeIO (None probes, False forces buffered I/O).
        chunk_bytes: NVMe request size (bytes); None = nvme.CHUNK_BYTES.
        host_pool_bytes: cap on host buffer bytes (dram copies + staging); None = unbounded.

    Files are removed on ``release``, ``close``, leaving a ``with`` block (also by an exception
    or Ctrl-C), and at interpreter exit.
    """

    def __init__(
        self,
        *,
        device: torch.device,
        nvme_dir: Path,
        io_threads: int = 2,
        hbm_limits: dict[str, int] | None = None,
        fault_hook: Callable[[IoEvent], None] | None = None,
        direct: bool | None = None,
        chunk_bytes: int | None = None,
        host_pool_bytes: int | None = None,
    ) -> None:
        self.dev = as_device(device)
        self.device = self.dev.torch_device
        io_kwargs = {} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}
        self.io = NvmeIO(nvme_dir, io_threads=io_threads, direct=direct, fault_hook=fault_hook,
                         device=self.dev, **io_kwargs)
        self._pool = HostBufferPool(device=self.dev, capacity_bytes=host_pool_bytes,
                                    wait_io=self._wait_buffer_io)
        self.d2h_stream = self.dev.stream("ckpt_d2h")
        self.h2d_stream = self.dev.stream("ckpt_h2d")
        self._limits = dict(hbm_limits or {})
        self._entries: dict[Key, BoundaryEntry] = {}
        self._current = dict.fromkeys(ACCOUNTING_KEYS, 0)
        self._peaks: dict[str, dict[str, int]] = {}
        self._moved: dict[str, dict[str, int]] = {}
        self._window: str | None = None
        self._window_keys: set[Key] = set()
        self._window_futures: list = []
        self._window_events: list = []
        self._unsettled: set[Key] = set()  # boundaries with NVMe writes still running
        self._closed = False
        atexit.register(self.close)

    # ---- windows -------------------------------------------------------------------------

    def set_hbm_limits(self, hbm_limits: dict[str, int] | None) -> None:
        """Replace the per-window HBM limits (a new plan's `hbm_checkpoint_bytes`; call
        between steps, as `Engine.set_plan` does)."""
        self._limits = dict(hbm_limits or {})

    def begin_window(self, name: str) -> None:
        """Open window ``name``; its peaks start at the bytes held now.

        Raises:
            RuntimeError: a window is already open.
            HbmBudgetExceeded: the bytes carried into the window exceed its limit.
        """
        if self._window is not None:
            raise RuntimeError(f"begin_window({name!r}) while window {self._window} is open")
        self._window = name
        self._moved.setdefault(name, dict.fromkeys(TRANSFER_ORDER, 0))
        peaks = self._peaks.setdefault(name, dict.fromkeys(ACCOUNTING_KEYS, 0))
        for tier, held in self._current.items():
            peaks[tier] = max(peaks[tier], held)
        self._check_hbm("at window start")

    def end_window(self) -> None:
        """Window barrier: later compute waits for the window's copies; buffers are released.

        Ordering rule (the store's one guarantee against use-after-free races): a buffer is
        released or handed back to the pool only after every copy that reads or writes it has
        completed. Here, without blocking the host on the device: the compute stream waits on
        every d2h/h2d event of the window (a stream wait); the window's NVMe reads are waited
        for (disk I/O only: a read depends on no device work, and the plan completes it within
        its window); NVMe writes are not (a write waits for its d2h, i.e. for device progress):
        they finish behind later windows and are settled at the first window end that finds them
        done, or waited for where their bytes are needed (the read-back, a pool buffer). Host
        buffers go back to the pool with their last copy events (``HostBufferPool.release``).
        Then: an offloaded boundary whose d2h is issued drops its HBM copy; an nvme boundary
        whose writes finished (and that is not being read) drops its staging buffer and closes
        its file; a boundary whose h2d is issued drops its host buffer.

        Raises:
            NvmeIOError: an NVMe read of the window, or a write found finished, failed
                (after every read of the window has finished).
        """
        if self._window is None:
            raise RuntimeError("end_window() without begin_window()")
        try:
            self.io.wait([f for f in self._window_futures
                          if getattr(f, "lazytrain_channel", None) == "nvme_read"])
            for event in self._window_events:
                # later compute sees finished copies (no host block on CUDA)
                self.dev.wait_event(self.dev.compute, event)
            self._unsettled |= self._window_keys
            for key in sorted(self._unsettled):
                e = self._entries.get(key)
                if e is None or self._settle(e):
                    self._unsettled.discard(key)
            self._pool.reclaim()
        finally:
            self._window = None
            self._window_keys = set()
            self._window_futures = []
            self._window_events = []

    def wait_writes(self) -> None:
        """Block until every NVMe write issued so far finished, then settle their boundaries
        (staging buffers back to the pool, files closed). The engine never needs it (reads wait
        for their writes); for measurements and tests that time or inspect a write.

        Raises:
            NvmeIOError: a write failed; NvmeTimeoutError: one is stuck.
        """
        for key in sorted(self._unsettled):
            e = self._entries.get(key)
            if e is not None:
                self.io.wait(e.write_futures)
                self._settle(e)
            self._unsettled.discard(key)

    def _settle_overdue_writes(self) -> None:
        """Wait for the NVMe writes of earlier windows and settle them, before the pool grows:
        the plan completes a write within its window, so its staging buffer counts as free in
        every later window's pinned bytes (`Predicted.pinned_bytes`); a write still running
        there is the device or the drive lagging, and the host waits rather than allocating
        past the plan."""
        for key in sorted(self._unsettled):
            e = self._entries.get(key)
            if e is not None and e.write_window != self._window:
                self.io.wait(e.write_futures)
                if self._settle(e):
                    self._unsettled.discard(key)
        self._pool.reclaim()

    def _settle(self, e: BoundaryEntry) -> bool:
        """Release what the issued copies of ``e`` no longer need (see ``end_window``); True when
        nothing is left to settle until its next transfer.

        Raises:
            NvmeIOError: a finished NVMe write of ``e`` failed.
        """
        if e.tier in ("dram", "nvme") and e.src is not None and e.done["d2h"] == e.nbytes:
            self.dev.discard(e.src)  # drained: the compute stream already waits on the d2h
            e.src = None
            self._count("hbm", -e.nbytes)
        write_done = e.done["nvme_write"] == e.padded_bytes
        if e.tier == "nvme" and write_done and e.host is not None and not e.read_started:
            if not all(f.done() for f in e.write_futures):
                return False  # still writing: settled at a later window end
            self.io.wait(e.write_futures)  # finished: raise a failed one now
            self.io.finish_write(e.key)
            self._release_host(e)
        source_done = e.done["d2h"] == e.nbytes if e.tier == "dram" else e.done["nvme_read"] == e.padded_bytes
        if e.host is not None and e.done["h2d"] == e.nbytes and source_done:
            if e.tier == "nvme":
                self.io.finish_read(e.key)
            self._release_host(e)
        return True

    # ---- boundaries ----------------------------------------------------------------------

    def put(self, boundary: int, tensor: torch.Tensor, tier: str, *, micro_batch: int = 0) -> None:
        """Store boundary ``boundary``'s tensor (kept by reference; do not modify it afterwards).

        Args:
            boundary: boundary index i (0..L).
            tensor: contiguous device tensor, e.g. [batch, seq, hidden] bf16/fp32.
            tier: "hbm", "dram", "nvme" or "recompute" (all start in HBM).
            micro_batch: micro-batch index.

        Raises:
            ValueError: unknown tier, tensor on another device or not contiguous, already stored.
            HbmBudgetExceeded: the window's HBM limit is exceeded.
        """
        if tier not in STORE_TIERS:
            raise ValueError(f"tier must be one of {STORE_TIERS}; got {tier!r}")
        key = (boundary, micro_batch)
        label = boundary_label(*key)
        if key in self._entries:
            raise ValueError(f"{label} is already stored; release it first")
        if tensor.device.type != self.device.type:
            raise ValueError(f"{label}: tensor on {tensor.device}, store on {self.device}")
        if not tensor.is_contiguous():
            raise ValueError(f"{label}: tensor must be contiguous (the store moves flat byte ranges)")
        nbytes = tensor.numel() * tensor.element_size()
        self.dev.ledger.relabel(tensor, f"boundary {boundary} ({tier})")
        self._entries[key] = BoundaryEntry(key=key, tier=tier, shape=tensor.shape,
                                           dtype=tensor.dtype, nbytes=nbytes, src=tensor)
        if tier in ("dram", "nvme"):  # its d2h, issued later, waits for no newer compute
            self._entries[key].produced = self.dev.record(self.dev.compute)
        self._count("hbm", nbytes)
        if self._window is not None:
            self._window_keys.add(key)
            self._check_hbm(f"put {label}")

    def transfer(self, boundary: int, kind: str, fraction: float, *, micro_batch: int = 0) -> None:
        """Issue one plan transfer: ``fraction`` of the boundary's bytes, in the open window.

        Fractions of one (boundary, kind) accumulate; the k-th call moves the flattened byte
        range [round(cum_before * n), round(cum_after * n)) (the last one ends at n). NVMe
        ranges are rounded to 4 KiB (writes down, reads up; the last write covers the padded
        file), and a kind never moves bytes its source kind has not delivered yet: what it
        cannot move now moves with its next fraction. An h2d issued while the boundary's HBM
        copy is still held (its d2h not yet released by a window barrier) adopts that copy as
        the prefetched one and moves nothing, so the boundary is held once, as the execution
        model's holding interval says.

        Raises:
            ValueError: unknown kind, kind not valid for the tier, fractions summing past 1.
            TransferOrderError: no open window, unknown boundary, or the last fraction of a kind
                issued before its source kind completed.
            NvmeIOError: opening the boundary's file failed (missing file, disk full).
            HbmBudgetExceeded: the window's HBM limit is exceeded (first h2d allocates).
        """
        key = (boundary, micro_batch)
        label = boundary_label(*key)
        if self._window is None:
            raise TransferOrderError(f"{label}: {kind} issued outside a window", boundary=boundary,
                                     micro_batch=micro_batch)
        if key not in self._entries:
            raise TransferOrderError(f"{label}: {kind} of a boundary that is not stored",
                                     boundary=boundary, micro_batch=micro_batch)
        e = self._entries[key]
        if kind not in _KINDS_BY_TIER[e.tier]:
            raise ValueError(f"{label}: transfer kind {kind!r} is not valid for tier {e.tier!r}")
        if not fraction > 0:
            raise ValueError(f"{label}: {kind} fraction must be > 0; got {fraction}")
        e.cum[kind] += fraction
        if e.cum[kind] > 1 + _FRACTION_TOL:
            raise ValueError(f"{label}: {kind} fractions sum to {e.cum[kind]:.6f} > 1")
        final = e.cum[kind] >= 1 - _FRACTION_TOL
        target = e.nbytes if final else round(e.cum[kind] * e.nbytes)
        before = e.done[kind]
        {"d2h": self._d2h, "nvme_write": self._nvme_write, "nvme_read": self._nvme_read,
         "h2d": self._h2d}[kind](e, target, final)
        if not (kind == "h2d" and e.aliased):  # an aliased h2d moves nothing
            self._moved[self._window][kind] += e.done[kind] - before
        self._window_keys.add(key)
        self._check_hbm(f"{kind} of {label}")

    def get(self, boundary: int, *, micro_batch: int = 0) -> torch.Tensor:
        """The boundary's device tensor, with its original shape and dtype.

        Raises:
            CheckpointNotResidentError: not stored, or an offloaded boundary whose h2d fractions
                do not cover all its bytes yet (never returns partial data).
        """
        key = (boundary, micro_batch)
        e = self._entries.get(key)
        if e is None:
            raise CheckpointNotResidentError(f"{boundary_label(*key)} is not in the activation store",
                                             boundary=boundary, micro_batch=micro_batch)
        if e.tier in ("hbm", "recompute"):
            return e.src
        if e.dev is None or e.done["h2d"] < e.nbytes:
            raise CheckpointNotResidentError(
                f"{e.label} (tier {e.tier}) is not resident in HBM: h2d moved {e.done['h2d']} of "
                f"{e.nbytes} bytes (h2d fractions issued: {e.cum['h2d']:.3f}); the plan must "
                "prefetch it completely before the window that uses it",
                boundary=boundary, micro_batch=micro_batch)
        self.dev.wait_event(self.dev.compute, e.h2d_event)
        return e.dev.view(e.dtype).view(e.shape)

    def release(self, boundary: int, *, micro_batch: int = 0) -> None:
        """Drop the boundary: its HBM, host and device buffers and its file.

        No buffer is freed under a running copy, and the host does not block on the device: the
        host buffer goes back to the pool with its last copy events, the HBM copy is freed after
        a compute-stream wait on its d2h (the prefetched copy was recorded on the h2d stream);
        the file is removed after its NVMe requests finished (their errors are ignored here:
        ``end_window`` or the read-back reports them).
        """
        e = self._entries.pop((boundary, micro_batch), None)
        if e is None:
            raise ValueError(f"{boundary_label(boundary, micro_batch)} is not stored")
        self._unsettled.discard(e.key)
        if (e.src is not None or e.aliased) and e.d2h_event is not None:
            # the allocator frees the HBM copy (also one an h2d adopted) on compute: after the d2h
            self.dev.wait_event(self.dev.compute, e.d2h_event)
        for copy in (e.src, e.dev):
            if copy is not None:
                self._count("hbm", -e.nbytes)
                self.dev.discard(copy)
        if e.host is not None:
            self._release_host(e)
        if e.file_bytes:
            self._count("nvme", -e.file_bytes)
        self.io.remove(e.key)  # waits for the key's NVMe requests (errors ignored)

    # ---- accounting ----------------------------------------------------------------------

    def bytes_by_tier(self) -> dict[str, int]:
        """Bytes held now per accounting key (hbm, dram, dram_staging, nvme)."""
        return dict(self._current)

    def peak_by_window(self) -> dict[str, dict[str, int]]:
        """Peak bytes per accounting key in each window entered since the last reset."""
        return {w: dict(p) for w, p in self._peaks.items()}

    def bytes_moved_by_window(self) -> dict[str, dict[str, int]]:
        """Bytes moved per transfer kind in each window (NVMe kinds include 4 KiB padding)."""
        return {w: dict(m) for w, m in self._moved.items()}

    def reset_peaks(self) -> None:
        """Forget peaks and moved bytes (e.g. between steps); an open window restarts at now."""
        self._peaks.clear()
        self._moved.clear()
        if self._window is not None:
            self._peaks[self._window] = dict(self._current)
            self._moved[self._window] = dict.fromkeys(TRANSFER_ORDER, 0)

    def stored(self) -> list[Key]:
        """(boundary, micro_batch) of every stored boundary."""
        return list(self._entries)

    # ---- lifetime ------------------------------------------------------------------------

    def close(self) -> None:
        """Release every boundary, delete every file, stop the I/O threads. Idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        for key in list(self._entries):
            self.release(key[0], micro_batch=key[1])
        try:
            self._pool.reclaim(block=True)
        except NvmeTimeoutError:
            pass  # a stuck drive: its buffers are abandoned, close still removes the files
        self.io.close()

    def __enter__(self) -> ActivationStore:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # ---- copies ----------------------------------------------------------------------------

    def _d2h(self, e: BoundaryEntry, target: int, final: bool) -> None:
        if e.host is None:
            self._acquire_host(e)
        start = e.done["d2h"]
        # Order after the compute that produced the tensor (queued before its put), not the
        # window's own compute queued since. The HBM copy is dropped only after the compute
        # stream waited for this copy's event (window barrier), so no record_stream.
        self.dev.wait_event(self.d2h_stream, e.produced)
        e.d2h_event = self._track(self.dev.copy(e.host[start:target],
                                                e.flat_bytes()[start:target],
                                                stream=self.d2h_stream))
        e.done["d2h"] = target

    def _nvme_write(self, e: BoundaryEntry, target: int, final: bool) -> None:
        available = e.done["d2h"]
        if final and available < e.nbytes:
            raise TransferOrderError(
                f"{e.label}: last nvme_write fraction before d2h completed ({available} of "
                f"{e.nbytes} bytes in DRAM)", boundary=e.key[0], micro_batch=e.key[1])
        end = e.padded_bytes if final else align_down(min(target, available))
        start = e.done["nvme_write"]
        if end <= start:
            return
        if not e.file_bytes:
            e.file_bytes = e.padded_bytes  # the padded file, counted from its creation
            self._count("nvme", e.file_bytes)
        event = e.d2h_event
        wait_for = event.synchronize if event is not None else None  # bytes final in DRAM
        futures = self.io.write(e.key, e.host[start:end], start, wait_for=wait_for)
        e.write_window = self._window
        e.write_futures += futures
        self._window_futures += futures
        e.done["nvme_write"] = end

    def _nvme_read(self, e: BoundaryEntry, target: int, final: bool) -> None:
        written = e.done["nvme_write"]
        if final and written < e.padded_bytes:
            raise TransferOrderError(
                f"{e.label}: last nvme_read fraction before nvme_write completed ({written} of "
                f"{e.padded_bytes} bytes written)", boundary=e.key[0], micro_batch=e.key[1])
        end = e.padded_bytes if final else min(align_up(target), written)
        start = e.done["nvme_read"]
        if end <= start:
            return
        self.io.wait(e.write_futures)  # read only bytes already on disk
        if e.host is None:
            self._acquire_host(e)
        e.read_started = True
        futures = self.io.read(e.key, e.host[start:end], start)
        e.read_futures += futures
        self._window_futures += futures
        e.done["nvme_read"] = end

    def _h2d(self, e: BoundaryEntry, target: int, final: bool) -> None:
        if e.dev is None and e.src is not None:
            # The HBM copy was not released yet (d2h incomplete, or completed in this window):
            # it becomes the prefetched copy, so the boundary is held once, continuously, as
            # the execution model's holding interval [i, 2L-i] says; nothing needs to move.
            e.dev, e.src, e.aliased = e.flat_bytes(), None, True
        if e.aliased:
            e.done["h2d"] = target
            return
        available = e.done["d2h"] if e.tier == "dram" else min(e.done["nvme_read"], e.nbytes)
        if final and available < e.nbytes:
            source = "d2h" if e.tier == "dram" else "nvme_read"
            raise TransferOrderError(
                f"{e.label}: last h2d fraction before {source} completed ({available} of "
                f"{e.nbytes} bytes in DRAM)", boundary=e.key[0], micro_batch=e.key[1])
        end = min(target, available)
        start = e.done["h2d"]
        if end <= start:
            return
        if e.tier == "nvme":
            self.io.wait(e.read_futures)  # sync point: bytes read back before they are sent
        if e.dev is None:
            self._allocate_prefetch(e)
        # Order after the device buffer's allocation (the compute queued before it: all so far,
        # or up to `reserve_h2d`'s event) and the d2h that filled the host copy (an NVMe read
        # was waited for on the host above).
        if e.dev_allocated is None:
            self.dev.wait_stream(self.h2d_stream, self.dev.compute)
        else:
            self.dev.wait_event(self.h2d_stream, e.dev_allocated)
        self.dev.wait_event(self.h2d_stream, e.d2h_event)
        e.h2d_event = self._track(self.dev.copy(e.dev[start:end], e.host[start:end],
                                                stream=self.h2d_stream))
        self.dev.record_stream(e.dev, self.h2d_stream)
        e.done["h2d"] = end

    def reserve_h2d(self, boundary: int, *, micro_batch: int = 0) -> None:
        """Allocate the boundary's prefetch buffer now, for an h2d issued later in the window:
        issued after the window's compute, that h2d waits only for the compute queued before
        this allocation (the caching allocator's rule), not for the window's own kernels.
        Nothing for a boundary whose HBM copy an h2d would adopt, or already allocated."""
        e = self._entries[(boundary, micro_batch)]
        if e.dev is None and e.src is None:
            self._allocate_prefetch(e)
            e.dev_allocated = self.dev.record(self.dev.compute)
            self._check_hbm(f"h2d buffer of {e.label}")

    def _allocate_prefetch(self, e: BoundaryEntry) -> None:
        e.dev = self.dev.empty(e.nbytes, torch.uint8, name=f"prefetched copy of {e.label}")
        self._count("hbm", e.nbytes)  # prefetched copy counts from its allocation

    def _track(self, event):
        """Remember a copy's event for the window barrier."""
        self._window_events.append(event)
        return event

    # ---- buffers and counters ------------------------------------------------------------

    def _wait_buffer_io(self, futures: list, key: Key) -> None:
        """The pool's wait for the NVMe requests on boundary ``key``'s host buffer: at most
        ``runtime.nvme_timeout_s`` (not at all once the drive is known stuck). A failed request
        is not raised here (the window end or the read-back reports it, where its bytes would
        be used).

        Raises:
            NvmeTimeoutError: some request is still running (the pool abandons the buffer).
        """
        if self.io.stuck and not all(f.done() for f in futures):
            raise NvmeTimeoutError(
                f"{boundary_label(*key)}: NVMe requests on its host buffer are still running "
                f"after an earlier wait timed out (runtime.nvme_timeout_s={self.io.timeout_s}): "
                "the drive is stuck; check it (dmesg, nvme smart-log) or raise "
                "runtime.nvme_timeout_s", boundary=key[0], micro_batch=key[1],
                path=self.io.path_for(key))
        try:
            self.io.wait(futures)
        except NvmeTimeoutError:
            raise
        except NvmeIOError:
            pass  # reported by end_window or the read-back

    def _acquire_host(self, e: BoundaryEntry) -> None:
        # a dram copy is exactly the boundary (the plan's A); an NVMe bounce buffer is padded
        # to the 4 KiB O_DIRECT block, with zeroed padding (deterministic files)
        nbytes = e.nbytes if e.tier == "dram" else e.padded_bytes
        if not self._pool.has(nbytes):
            self._settle_overdue_writes()
        e.host = self._pool.acquire(nbytes)
        if e.tier == "nvme":
            e.host[e.nbytes:].zero_()
        self._count(*self._host_account(e))

    def _release_host(self, e: BoundaryEntry) -> None:
        """Hand ``e.host`` back to the pool, reusable once its last copies and NVMe requests
        finished (the pool may give it to another stream); no host block here."""
        tier, nbytes = self._host_account(e)
        self._count(tier, -nbytes)
        self._pool.release(e.host, after=(e.d2h_event, e.h2d_event),
                           futures=e.write_futures + e.read_futures, owner=e.key)
        e.host = None

    @staticmethod
    def _host_account(e: BoundaryEntry) -> tuple[str, int]:
        return ("dram", e.nbytes) if e.tier == "dram" else ("dram_staging", e.padded_bytes)

    def _count(self, tier: str, delta: int) -> None:
        self._current[tier] += delta
        if self._window is not None:
            peaks = self._peaks[self._window]
            peaks[tier] = max(peaks[tier], self._current[tier])

    def _check_hbm(self, context: str) -> None:
        limit = self._limits.get(self._window)
        held = self._current["hbm"]
        if limit is not None and held > limit:
            raise HbmBudgetExceeded(window=self._window, held_bytes=held, limit_bytes=limit,
                                    detail=context)
