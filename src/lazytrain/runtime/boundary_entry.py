"""What the activation store records about one stored boundary: its tier, shape and size, its
HBM, host and prefetched copies, and how far each transfer kind has moved it.

Owns `BoundaryEntry`, a mutable record that only `runtime/activations.py` (the store) reads and
writes; the store's protocol (windows, transfers, accounting) lives there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lazytrain.contract import align_up
from lazytrain.planner.windows import TRANSFER_KINDS
from lazytrain.runtime.errors import boundary_label
from lazytrain.runtime.nvme import Key


@dataclass(slots=True)
class BoundaryEntry:
    """One stored boundary of one micro-batch (mutable; the store's alone)."""

    key: Key
    tier: str
    shape: torch.Size
    dtype: torch.dtype
    nbytes: int
    src: torch.Tensor | None  # the tensor as put: the HBM copy (offloaded tiers: until drained)
    host: torch.Tensor | None = None  # uint8 [align_up(nbytes)], aligned; dram copy or staging
    dev: torch.Tensor | None = None  # uint8 [nbytes] on the device: the prefetched copy
    aliased: bool = False  # dev is the put tensor itself (h2d began before it was released)
    file_bytes: int = 0  # NVMe bytes accounted (padded file size), from the first write on
    read_started: bool = False
    write_window: str | None = None  # the window of the last nvme_write fraction
    cum: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TRANSFER_KINDS, 0.0))
    # End offset (bytes) issued per kind; nvme kinds in file coordinates (4 KiB-aligned).
    done: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TRANSFER_KINDS, 0))
    d2h_event: object | None = None  # device API event of the last d2h copy
    h2d_event: object | None = None
    dev_allocated: object | None = None  # compute event at a reserved dev's allocation
    produced: object | None = None  # compute event at the put (offloaded tiers): its d2h waits
    write_futures: list = field(default_factory=list)
    read_futures: list = field(default_factory=list)

    @property
    def label(self) -> str:
        return boundary_label(*self.key)

    @property
    def padded_bytes(self) -> int:
        return align_up(self.nbytes)

    def flat_bytes(self) -> torch.Tensor:
        """The HBM copy as ``uint8`` [nbytes] (a view of the put tensor, no copy)."""
        if self.aliased:
            return self.dev
        return self.src.detach().reshape(-1).view(torch.uint8)
