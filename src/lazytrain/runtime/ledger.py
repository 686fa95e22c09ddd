"""The allocation and transfer ledger: every byte the runtime holds or moves, per window.

Owns two accounts, both fed by the device API (`runtime/device.py`), so the numbers are the
same code on every backend:
- allocations: every device (HBM) and pinned host allocation, with its owner ("weight slot 2",
  "ends gradient", "boundary 5 (micro-batch 0) prefetch", "block workspace", ...), its size and
  the window it was made in; released when the tensor's storage is freed (a storage finalizer)
  or explicitly. A reservation that would pass the window's budget raises
  `HbmBudgetExceeded` / `HostBudgetExceeded` before the tensor is requested, naming the owner
  and the window. On the CPU backends compute allocations (block intermediates, autograd-saved
  tensors of kept graphs, the head's logits) are seen through a `TorchDispatchMode` as fresh op
  outputs and booked to the current compute owner; on CUDA the caching allocator's
  `memory_stats` cross-check the ledger (`benchmarks/gpu_validate.py`);
- transfers: bytes moved per window and channel (h2d, d2h, nvme_read, nvme_write).

Knows nothing about plans: the engine hands it per-window budgets and names the windows.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lazytrain.runtime.errors import HbmBudgetExceeded, HostBudgetExceeded

CHANNELS = ("h2d", "d2h", "nvme_read", "nvme_write")
KINDS = ("hbm", "pinned")
OUTSIDE = "(outside a window)"
"""Window name of allocations and transfers made between windows (set-up, optimizer tail)."""


@dataclass(slots=True)
class _Peak:
    bytes: int = 0
    owners: dict = field(default_factory=dict)
    """owner -> bytes at the moment of the peak."""


class Ledger:
    """Bytes held per kind and owner, and bytes moved per channel, window by window.

    Args:
        hbm_limits: window name -> the plan's peak HBM bytes for that window; the key "*"
            applies to every window without its own (None: no check).
        pinned_limit_bytes: the plan's pinned host bytes (None: no check).
    """

    def __init__(self, *, hbm_limits: dict[str, int] | None = None,
                 pinned_limit_bytes: int | None = None) -> None:
        self._lock = threading.RLock()
        self.hbm_limits = dict(hbm_limits or {})
        self.pinned_limit_bytes = pinned_limit_bytes
        self.window = OUTSIDE
        self.compute_owner = "workspace"
        self._held: dict[str, dict[str, int]] = {k: defaultdict(int) for k in KINDS}
        self._total = dict.fromkeys(KINDS, 0)
        self._peaks: dict[str, dict[str, _Peak]] = {}
        self._moved: dict[str, dict[str, int]] = {}
        self._live: dict[int, tuple[str, str, int]] = {}  # storage ptr -> (kind, owner, bytes)
        self._quiet = threading.local()

    @contextlib.contextmanager
    def quiet(self):
        """The compute mode books nothing inside (the device API books its own allocations)."""
        prev = getattr(self._quiet, "on", False)
        self._quiet.on = True
        try:
            yield
        finally:
            self._quiet.on = prev

    @contextlib.contextmanager
    def booked_to(self, window: str):
        """Book this thread's transfers to `window` (a worker issuing a copy the engine asked
        for in that window, e.g. a weight load queued by the conversion worker)."""
        prev = getattr(self._quiet, "window", None)
        self._quiet.window = window
        try:
            yield
        finally:
            self._quiet.window = prev

    @property
    def is_quiet(self) -> bool:
        return getattr(self._quiet, "on", False)

    # --- windows -----------------------------------------------------------------------------

    def set_limits(self, *, hbm_limits: dict[str, int] | None = None,
                   pinned_limit_bytes: int | None = None) -> None:
        """New budgets (a new plan; call between steps)."""
        self.hbm_limits = dict(hbm_limits or {})
        self.pinned_limit_bytes = pinned_limit_bytes

    def begin_window(self, name: str) -> None:
        """Book what follows to window `name`; its peak starts at the bytes held now."""
        with self._lock:
            self.window = name
            self._note_peak()

    def end_window(self) -> None:
        with self._lock:
            self.window = OUTSIDE

    def reset(self) -> None:
        """Forget peaks and moved bytes (a new step); holdings stay."""
        with self._lock:
            self._peaks.clear()
            self._moved.clear()
            self._note_peak()

    # --- allocations -------------------------------------------------------------------------

    def reserve(self, kind: str, owner: str, nbytes: int) -> None:
        """Book `nbytes` of `kind` ("hbm" or "pinned") to `owner` in the current window.

        Raises:
            HbmBudgetExceeded / HostBudgetExceeded: the window's budget would be passed; nothing
                is booked (call before requesting the memory).
        """
        with self._lock:
            now = self._total[kind] + nbytes
            if kind == "hbm":
                limit = self.hbm_limits.get(self.window, self.hbm_limits.get("*"))
                if limit is not None and now > limit:
                    raise HbmBudgetExceeded(window=self.window, held_bytes=now, limit_bytes=limit,
                                            owner=owner, detail=self._top(kind))
            elif self.pinned_limit_bytes is not None and now > self.pinned_limit_bytes:
                raise HostBudgetExceeded(window=self.window, held_bytes=now,
                                         limit_bytes=self.pinned_limit_bytes, owner=owner,
                                         detail=self._top(kind))
            self._held[kind][owner] += nbytes
            self._total[kind] = now
            self._note_peak()

    def release(self, kind: str, owner: str, nbytes: int) -> None:
        with self._lock:
            self._held[kind][owner] -= nbytes
            if not self._held[kind][owner]:
                del self._held[kind][owner]
            self._total[kind] -= nbytes

    def track(self, tensor: torch.Tensor, kind: str, owner: str, *,
              reserved: int | None = None) -> None:
        """Book `tensor`'s storage to `owner` until the storage is freed (once per storage).

        Args:
            reserved: bytes already booked by `reserve` for this tensor (the device API reserves
                before it allocates); None: reserve the storage's bytes now.
        """
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        nbytes = storage.nbytes() if reserved is None else reserved
        if not ptr or not nbytes:
            if reserved:
                self.release(kind, owner, reserved)
            return
        with self._lock:
            if ptr in self._live:
                if reserved:
                    self.release(kind, owner, reserved)
                return
            if reserved is None:
                self.reserve(kind, owner, nbytes)
            self._live[ptr] = (kind, owner, nbytes)
        weakref.finalize(storage, self._freed, ptr, kind, owner, nbytes)

    def relabel(self, tensor: torch.Tensor, owner: str) -> None:
        """Book `tensor`'s storage to `owner` from now on (e.g. a block output the store keeps
        as a boundary); untracked storages are left alone."""
        ptr = tensor.untyped_storage().data_ptr()
        with self._lock:
            entry = self._live.get(ptr)
            if entry is None or entry[1] == owner:
                return
            kind, old, nbytes = entry
            self._held[kind][old] -= nbytes
            if not self._held[kind][old]:
                del self._held[kind][old]
            self._held[kind][owner] += nbytes
            self._live[ptr] = (kind, owner, nbytes)

    def tracked(self, tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage().data_ptr() in self._live

    def _freed(self, ptr: int, kind: str, owner: str, nbytes: int) -> None:
        with self._lock:
            entry = self._live.get(ptr)
            if entry is not None and entry[0] == kind and entry[2] == nbytes:
                owner = entry[1]  # relabelled since
                del self._live[ptr]
            self.release(kind, owner, nbytes)

    # --- transfers ---------------------------------------------------------------------------

    def moved(self, channel: str, nbytes: int) -> None:
        """`nbytes` moved on `channel` in the current window."""
        window = getattr(self._quiet, "window", None) or self.window
        with self._lock:
            w = self._moved.setdefault(window, dict.fromkeys(CHANNELS, 0))
            w[channel] += nbytes

    # --- reading -----------------------------------------------------------------------------

    def held_bytes(self, kind: str = "hbm") -> int:
        return self._total[kind]

    def held_by_owner(self, kind: str = "hbm") -> dict[str, int]:
        return dict(self._held[kind])

    def peak_by_window(self, kind: str = "hbm") -> dict[str, int]:
        """Peak bytes of `kind` per window since the last reset."""
        return {w: p[kind].bytes for w, p in self._peaks.items()}

    def peak_bytes(self, kind: str = "hbm") -> int:
        return max([p[kind].bytes for p in self._peaks.values()] or [self._total[kind]])

    def peak_owners(self, kind: str = "hbm") -> tuple[str, dict[str, int]]:
        """(window, owner -> bytes) at the highest peak of `kind` since the last reset."""
        best = max(self._peaks.items(), key=lambda kv: kv[1][kind].bytes, default=None)
        if best is None:
            return OUTSIDE, dict(self._held[kind])
        return best[0], dict(best[1][kind].owners)

    def moved_by_window(self) -> dict[str, dict[str, int]]:
        return {w: dict(m) for w, m in self._moved.items()}

    def _note_peak(self) -> None:
        peaks = self._peaks.setdefault(self.window, {k: _Peak() for k in KINDS})
        for kind in KINDS:
            if self._total[kind] >= peaks[kind].bytes:
                peaks[kind].bytes = self._total[kind]
                peaks[kind].owners = dict(self._held[kind])

    def _top(self, kind: str, n: int = 4) -> str:
        top = sorted(self._held[kind].items(), key=lambda kv: -kv[1])[:n]
        return "largest holders: " + ", ".join(f"{o} {b}" for o, b in top)


class ComputeAllocations(TorchDispatchMode):
    """Books every fresh output of a torch op (a new storage) to the ledger's compute owner.

    Views and in-place ops allocate nothing; an output whose storage is already booked (e.g. a
    buffer the device API allocated) is not booked twice.
    """

    def __init__(self, ledger: Ledger, *, device_type: str = "cpu") -> None:
        super().__init__()
        self.ledger = ledger
        self.device_type = device_type

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        aliases = _RETURNS_ALIAS.get(func)
        if aliases is None:  # per op, once: its schema says whether results alias inputs
            aliases = _RETURNS_ALIAS[func] = any(r.alias_info is not None
                                                 for r in func._schema.returns)
        if aliases or self.ledger.is_quiet:
            return out  # a view or an in-place result: no new storage
        outs = (out,) if isinstance(out, torch.Tensor) else tree_flatten(out)[0]
        for t in outs:
            if (isinstance(t, torch.Tensor) and t.device.type == self.device_type
                    and not self.ledger.tracked(t)):
                self.ledger.track(t, "hbm", self.ledger.compute_owner)
        return out


_RETURNS_ALIAS: dict = {}
"""op -> whether its results alias its inputs (views, in-place ops): cached per op."""
