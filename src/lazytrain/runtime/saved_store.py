"""The saved-internals store: where an L1/L2 block's saved tensors live between `f{j}` and `b{j}`.

Owns the saved storages of the blocks whose plan level is L1 or L2 (docs/execution_model.md,
"Save levels"): per (block, micro-batch) the `SavedInternals` that `models/saved_tensors.py`'s
`forward_saving` returned, their tier (`hbm`: kept on the device until `b{j}`; `dram`: moved to
page-locked host memory and back in the windows of the plan's `internal_transfers`), the byte
ranges each transfer fraction moves, the window barrier that releases drained device copies, and
the bytes moved per window. It decides nothing: the engine calls `put` / `transfer` / `take` /
`release` as the plan says. Knows nothing about autograd, weights or boundaries.

Byte ranges: the storages of one block (uint8 1-D device tensors) are treated as one
concatenated range of `S = sum(sizes)` bytes; a transfer fraction moves
`[round(cum_before * S), round(cum_after * S))` of it (the last fraction ends at S), split at
the storages' edges, as the activation store moves a boundary's flat bytes. The host copy is
one page-locked buffer holding storage k at offset `sum(align16(size) for the ones before)`:
`SavedInternals.replace_storages` takes views of it that start 16-byte aligned (at most 15
bytes of padding per storage).

Device path: the copies run on the activation store's copy streams (`ckpt_d2h`, `ckpt_h2d`)
through the device API, with host buffers from a bounded pool of page-locked buffers
(`runtime/host_pool.py`, booked to the ledger owner "saved internals host buffer"), so the
ordering checkers (`cpu-checked`, `cpu-threaded`) see every access:
- a d2h waits for the compute event recorded at `put` (the forward that produced the tensors);
- at the barrier of the window holding a block's last d2h fraction the compute stream waits for
  the window's copies, the saved graph is pointed at the host copy (`replace_storages`: it
  holds its storages nowhere else) and the device copies are discarded;
- the first h2d allocates new device buffers (on the compute stream, booked to the owner
  "saved internals of block j"), the copies wait for that allocation and for the d2h; the last
  one hands them to the saved graph (`replace_storages`); `take` makes the compute stream wait
  for the h2d before `b{j}` reads them;
- the host buffer goes back to the pool with its last copy events (no host block).
Nothing here blocks the host on the device except the pool's back-pressure and, where pinning
a host buffer would pass the pinned budget, the wait before idle pool buffers are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lazytrain.runtime.device import Device
from lazytrain.runtime.errors import HostBudgetExceeded, TransferOrderError
from lazytrain.runtime.host_pool import HostBufferPool

SAVED_TIERS = ("hbm", "dram")
"""Tiers of saved internals (Plan JSON `saved_tiers`, besides "none")."""

SAVED_KINDS = ("d2h", "h2d")
"""Transfer kinds of saved internals (Plan JSON `internal_transfers`), in issue order."""

HOST_ALIGN = 16
"""Byte alignment of each storage's view in the host copy (`replace_storages` requires it)."""

_FRACTION_TOL = 1e-6
"""Cumulative fractions within this of 1 count as complete (plans store floats)."""

Key = tuple[int, int]
"""(block, micro_batch)."""


def saved_owner(block: int) -> str:
    """The ledger owner of block `block`'s saved internals in HBM."""
    return f"saved internals of block {block}"


@dataclass(slots=True)
class _Entry:
    """One block's saved internals of one micro-batch (mutable; the store's alone)."""

    key: Key
    tier: str
    saved: object  # models.saved_tensors.SavedInternals
    sizes: list[int]
    offsets: list[int]  # storage k's byte offset in the host copy (HOST_ALIGN-aligned)
    nbytes: int
    device: list | None  # the device storages held now (None: drained, not yet prefetched)
    produced: object | None = None  # compute event at `put`: the d2h waits for it
    host: torch.Tensor | None = None  # uint8 [nbytes] page-locked copy
    prefetch: list | None = None  # device buffers the h2d fills
    cum: dict = field(default_factory=lambda: dict.fromkeys(SAVED_KINDS, 0.0))
    done: dict = field(default_factory=lambda: dict.fromkeys(SAVED_KINDS, 0))
    adopted: bool = False  # an h2d found the device copies still held: nothing moved
    d2h_event: object | None = None
    h2d_event: object | None = None

    @property
    def label(self) -> str:
        return f"saved internals of block {self.key[0]} (micro-batch {self.key[1]})"


class SavedStore:
    """Saved internals of L1/L2 blocks in the tiers hbm / dram, moved as the plan says.

    Call protocol per window (as the activation store's): `begin_window(name)`; `transfer` the
    window's internal transfers (d2h before h2d); `end_window()`. `put` after `f{j}`'s forward,
    `take` in `b{j}`, `release` at the end of `b{j}`, `abandon` when a step fails.

    Args:
        device: the device API (the engine's).
        host_pool_bytes: cap on the pool's page-locked bytes; None = unbounded.
    """

    def __init__(self, device: Device, *, host_pool_bytes: int | None = None) -> None:
        self.dev = device
        self.d2h_stream = device.stream("ckpt_d2h")
        self.h2d_stream = device.stream("ckpt_h2d")
        self._pool = HostBufferPool(device=device, capacity_bytes=host_pool_bytes,
                                    owner="saved internals host buffer")
        self._entries: dict[Key, _Entry] = {}
        self._window: str | None = None
        self._window_events: list = []
        self._window_keys: set[Key] = set()
        self._moved: dict[tuple[int, str], dict[str, int]] = {}

    # ---- windows -------------------------------------------------------------------------

    def begin_window(self, name: str) -> None:
        """Open window `name` (transfers are booked to it)."""
        self._window = name

    def end_window(self) -> None:
        """Window barrier: the compute stream waits for the window's copies (no host block);
        then a dram entry whose d2h is complete drops its device copies, and one whose h2d is
        complete hands its host buffer back to the pool (reusable after its copy events)."""
        for event in self._window_events:
            self.dev.wait_event(self.dev.compute, event)
        for key in sorted(self._window_keys):
            e = self._entries.get(key)
            if e is not None:
                self._settle(e)
        self._pool.reclaim()
        self._window, self._window_events, self._window_keys = None, [], set()

    def _settle(self, e: _Entry) -> None:
        if (e.device is not None and e.prefetch is None and not e.adopted
                and e.done["d2h"] == e.nbytes):
            self._drop_device(e)  # drained; the compute stream already waits on the d2h
        if e.host is not None and e.done["h2d"] == e.nbytes and e.done["d2h"] == e.nbytes:
            self._release_host(e)

    # ---- entries -------------------------------------------------------------------------

    def put(self, block: int, saved, tier: str, *, micro_batch: int = 0) -> None:
        """Hold `saved` (a `SavedInternals` whose `storages` are uint8 1-D device tensors) for
        `b{block}`; its storages are booked to `saved_owner(block)` in the ledger.

        Raises:
            ValueError: unknown tier, or the block's internals are already held.
        """
        if tier not in SAVED_TIERS:
            raise ValueError(f"saved tier must be one of {SAVED_TIERS}; got {tier!r}")
        key = (block, micro_batch)
        if key in self._entries:
            raise ValueError(f"saved internals of block {block} (micro-batch {micro_batch}) "
                             "are already held; release them first")
        storages = list(saved.storages)
        for s in storages:
            self.dev.ledger.relabel(s, saved_owner(block))
        sizes = [s.numel() for s in storages]
        offsets, at = [], 0
        for n in sizes:
            offsets.append(at)
            at += -(-n // HOST_ALIGN) * HOST_ALIGN
        e = _Entry(key=key, tier=tier, saved=saved, sizes=sizes, offsets=offsets,
                   nbytes=sum(sizes), device=storages)
        if tier == "dram":  # its d2h, issued later, waits for no newer compute
            e.produced = self.dev.record(self.dev.compute)
        self._entries[key] = e

    def transfer(self, block: int, kind: str, fraction: float, *, micro_batch: int = 0) -> None:
        """Issue `fraction` of the block's saved bytes as `kind` ("d2h" or "h2d") in the open
        window (fractions of one kind accumulate; see the module docstring for the ranges).

        Raises:
            TransferOrderError: no open window; internals not held or not in the dram tier; an
                h2d before the d2h moved the bytes it needs.
            ValueError: unknown kind, fraction <= 0 or fractions summing past 1.
        """
        key = (block, micro_batch)
        e = self._entries.get(key)
        label = e.label if e is not None else f"saved internals of block {block}"
        if self._window is None:
            raise TransferOrderError(f"{label}: {kind} issued outside a window", boundary=block,
                                     micro_batch=micro_batch)
        if e is None or e.tier != "dram":
            raise TransferOrderError(f"{label}: {kind} of internals that are not held in the "
                                     "dram tier", boundary=block, micro_batch=micro_batch)
        if kind not in SAVED_KINDS:
            raise ValueError(f"{label}: transfer kind must be one of {SAVED_KINDS}; got {kind!r}")
        if not fraction > 0:
            raise ValueError(f"{label}: {kind} fraction must be > 0; got {fraction}")
        e.cum[kind] += fraction
        if e.cum[kind] > 1 + _FRACTION_TOL:
            raise ValueError(f"{label}: {kind} fractions sum to {e.cum[kind]:.6f} > 1")
        target = e.nbytes if e.cum[kind] >= 1 - _FRACTION_TOL else round(e.cum[kind] * e.nbytes)
        moved = (self._d2h if kind == "d2h" else self._h2d)(e, target)
        window = self._moved.setdefault((micro_batch, self._window), dict.fromkeys(SAVED_KINDS, 0))
        window[kind] += moved
        self._window_keys.add(key)

    def take(self, block: int, *, micro_batch: int = 0):
        """The block's `SavedInternals` for `b{block}`, its storages on the device (the compute
        stream waits for their h2d).

        Raises:
            TransferOrderError: not held, or a dram entry whose h2d has not moved every byte.
        """
        e = self._entries.get((block, micro_batch))
        if e is None:
            raise TransferOrderError(f"saved internals of block {block} (micro-batch "
                                     f"{micro_batch}) are not held", boundary=block,
                                     micro_batch=micro_batch)
        if e.device is None:
            raise TransferOrderError(
                f"{e.label} (tier dram) are not on the device: h2d moved {e.done['h2d']} of "
                f"{e.nbytes} bytes; the plan must prefetch them completely before b{block}",
                boundary=block, micro_batch=micro_batch)
        self.dev.wait_event(self.dev.compute, e.h2d_event)
        return e.saved

    def release(self, block: int, *, micro_batch: int = 0) -> None:
        """Drop the block's internals (end of `b{block}`): device copies and host buffer, no
        buffer freed under a running copy and no host block."""
        e = self._entries.pop((block, micro_batch), None)
        if e is None:
            raise ValueError(f"saved internals of block {block} (micro-batch {micro_batch}) "
                             "are not held")
        if e.d2h_event is not None:  # the allocator frees them on compute: after the d2h
            self.dev.wait_event(self.dev.compute, e.d2h_event)
        buffers = {id(t): t for t in (e.device or []) + (e.prefetch or [])}
        e.saved.release()  # the graph refers back to it: break the cycle (a failed step)
        e.saved = e.device = e.prefetch = None  # the graph's holders go first
        for t in buffers.values():
            self.dev.discard(t)
        if e.host is not None:
            self._release_host(e)

    def abandon(self) -> None:
        """A failed step: close the open window and release every entry (errors dropped)."""
        if self._window is not None:
            self.end_window()
        for block, micro_batch in list(self._entries):
            self.release(block, micro_batch=micro_batch)

    def held(self) -> list[Key]:
        """(block, micro_batch) of every held entry."""
        return list(self._entries)

    def bytes_held(self) -> dict[str, int]:
        """Saved bytes held now: "hbm" (device copies and prefetch buffers), "dram" (host)."""
        hbm = sum(e.nbytes for e in self._entries.values()
                  if e.device is not None or e.prefetch is not None)
        dram = sum(e.nbytes for e in self._entries.values() if e.host is not None)
        return {"hbm": hbm, "dram": dram}

    def moved(self, micro_batch: int, window: str) -> dict[str, int]:
        """Bytes moved per kind ("d2h", "h2d") in `window` of `micro_batch` since `reset`."""
        return dict(self._moved.get((micro_batch, window), dict.fromkeys(SAVED_KINDS, 0)))

    def reset(self) -> None:
        """Forget the bytes moved (a new step)."""
        self._moved.clear()

    def close(self) -> None:
        """Release every entry and wait for the pool's pending buffers."""
        self.abandon()
        self._pool.reclaim(block=True)

    # ---- copies ----------------------------------------------------------------------------

    def _pieces(self, e: _Entry, start: int, end: int):
        """(storage index, offset in it, length) covering [start, end) of the concatenated
        bytes."""
        base = 0
        for k, size in enumerate(e.sizes):
            lo, hi = max(start, base), min(end, base + size)
            if lo < hi:
                yield k, lo - base, hi - lo
            base += size

    def _d2h(self, e: _Entry, target: int) -> int:
        """Queue the d2h of [done, target); returns the bytes moved."""
        start = e.done["d2h"]
        if target <= start:
            return 0
        if e.device is None:
            raise TransferOrderError(f"{e.label}: d2h after its device copies were dropped",
                                     boundary=e.key[0], micro_batch=e.key[1])
        if e.host is None:
            last = len(e.sizes) - 1
            e.host = self._acquire_host(e.offsets[last] + e.sizes[last])
        # after the forward that produced them (queued before `put`), not the window's compute
        self.dev.wait_event(self.d2h_stream, e.produced)
        for k, off, n in self._pieces(e, start, target):
            at = e.offsets[k] + off
            e.d2h_event = self._track(self.dev.copy(e.host[at:at + n], e.device[k][off:off + n],
                                                    stream=self.d2h_stream))
        e.done["d2h"] = target
        return target - start

    def _h2d(self, e: _Entry, target: int) -> int:
        """Queue the h2d of [done, target); returns the bytes moved."""
        if e.done["d2h"] < e.nbytes:  # the contract: every h2d after the block's last d2h
            raise TransferOrderError(
                f"{e.label}: h2d before d2h completed ({e.done['d2h']} of {e.nbytes} bytes in "
                "DRAM); the plan puts every h2d window after the last d2h window",
                boundary=e.key[0], micro_batch=e.key[1])
        if e.adopted or (e.device is not None and e.prefetch is None):
            # the device copies are still held (the last d2h is in this window): they are the
            # prefetched copies and nothing moves (the plan's h2d never does this)
            e.adopted, e.done["h2d"] = True, target
            return 0
        start = e.done["h2d"]
        if target <= start:
            return 0
        if e.prefetch is None:
            e.prefetch = [self.dev.empty(n, torch.uint8, name=saved_owner(e.key[0]))
                          for n in e.sizes]
            # after the allocation (compute queued so far) and the d2h that filled the host
            self.dev.wait_stream(self.h2d_stream, self.dev.compute)
        self.dev.wait_event(self.h2d_stream, e.d2h_event)
        for k, off, n in self._pieces(e, start, target):
            at = e.offsets[k] + off
            e.h2d_event = self._track(self.dev.copy(e.prefetch[k][off:off + n],
                                                    e.host[at:at + n], stream=self.h2d_stream))
        for buf in e.prefetch:
            self.dev.record_stream(buf, self.h2d_stream)
        e.done["h2d"] = target
        if target == e.nbytes:  # the saved graph reads the prefetched copies from now on
            e.saved.replace_storages(list(e.prefetch))
            e.device = e.prefetch
        return target - start

    def _drop_device(self, e: _Entry) -> None:
        """The saved graph reads the host copy from now on (it holds its storages nowhere
        else); the device API discards the device copies."""
        storages, e.device = e.device, None
        e.saved.replace_storages([e.host[o:o + n] for o, n in zip(e.offsets, e.sizes)])
        for s in storages:
            self.dev.discard(s)

    def _acquire_host(self, nbytes: int) -> torch.Tensor:
        """A host buffer of `nbytes` from the pool. Where pinning it would pass the pinned
        budget, the pool's idle buffers (cached for sizes of an earlier batch: a padded batch's
        internals are larger, docs/execution_model.md "Save-level tensor sets") are dropped
        after their copies and the request is made once more; only then does
        `HostBudgetExceeded` propagate. The pool recycles by exact size, so without this a run
        that alternates batch kinds would hold both kinds' buffers against the budget."""
        try:
            return self._pool.acquire(nbytes)
        except HostBudgetExceeded:
            self._pool.reclaim(block=True)  # a host wait on this path only: else the step fails
            self._pool.drop_cached()
        return self._pool.acquire(nbytes)

    def _track(self, event):
        self._window_events.append(event)
        return event

    def _release_host(self, e: _Entry) -> None:
        self._pool.release(e.host, after=(e.d2h_event, e.h2d_event), owner=e.key)
        e.host = None
