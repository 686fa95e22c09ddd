"""Exceptions raised by the runtime's activation store and NVMe tier.

Owns the error types only; knows nothing about plans or tensors. Each error carries the fields a
caller needs to react (boundary, micro-batch, path, window) and a message that names them, so a
failed step reads like "boundary 7 (micro-batch 0): NVMe write to /x/ckpt_b7_m0.bin failed: No
space left on device".
"""

from __future__ import annotations

from pathlib import Path

from lazytrain.errors import JobFailure


def boundary_label(boundary: int, micro_batch: int) -> str:
    """The prefix every store error starts with, e.g. ``"boundary 7 (micro-batch 0)"``."""
    return f"boundary {boundary} (micro-batch {micro_batch})"


class NvmeIOError(JobFailure, OSError):
    """An NVMe-tier file operation failed: disk full, short read/write, missing file, ...

    About the boundary activations the plan puts on NVMe, not the training checkpoints
    (`train/checkpoint.py` raises `CheckpointError` for those).

    Attributes:
        boundary: boundary index i (0..L) whose activation file failed.
        micro_batch: micro-batch index of that activation.
        path: the file.
        errno: the underlying errno (e.g. ``errno.ENOSPC``), or None for a short read/write.
    """

    def __init__(
        self,
        message: str,
        *,
        boundary: int,
        path: Path | str,
        micro_batch: int = 0,
        errno_code: int | None = None,
    ) -> None:
        super().__init__(message)
        self.boundary = boundary
        self.micro_batch = micro_batch
        self.path = Path(path)
        self.errno = errno_code

    def __str__(self) -> str:
        return str(self.args[0])


class HbmBudgetExceeded(JobFailure):
    """The store holds more HBM bytes in a window than the plan's ``hbm_checkpoint_bytes``.

    The engine executes a validated plan, so this means the plan's accounting and the run
    disagree: a job failure (exit 1) that names the window and the bytes, not an assertion of
    ours (`except AssertionError` would hide it among bugs).

    Attributes:
        window: window name, e.g. ``"b3"``.
        held_bytes: HBM bytes the store holds at the moment of the check (bytes).
        limit_bytes: the plan's ``hbm_checkpoint_bytes`` for that window (bytes).
    """

    def __init__(self, *, window: str, held_bytes: int, limit_bytes: int, detail: str = "",
                 owner: str | None = None) -> None:
        if owner is None:
            msg = (f"window {window}: activation store holds {held_bytes} HBM bytes, over the "
                   f"plan's hbm_checkpoint_bytes {limit_bytes} by {held_bytes - limit_bytes}")
        else:
            msg = (f"window {window}: reserving HBM for {owner} would hold {held_bytes} bytes, "
                   f"over the plan's HBM budget {limit_bytes} by {held_bytes - limit_bytes}")
        super().__init__(msg + (f" ({detail})" if detail else ""))
        self.window = window
        self.held_bytes = held_bytes
        self.limit_bytes = limit_bytes
        self.owner = owner


class HostBudgetExceeded(JobFailure, RuntimeError):
    """A pinned host reservation would pass the plan's pinned budget (the DRAM left for
    DRAM-tier checkpoints and staging pools after the host states).

    Attributes:
        window: window name of the reservation.
        owner: what asked for the memory ("weight staging buffer 2", ...).
        held_bytes: pinned bytes held including the request (bytes).
        limit_bytes: the plan's pinned budget (bytes).
    """

    def __init__(self, *, window: str, held_bytes: int, limit_bytes: int, owner: str,
                 detail: str = "") -> None:
        super().__init__(f"window {window}: pinning host memory for {owner} would hold "
                         f"{held_bytes} bytes, over the plan's pinned budget {limit_bytes} by "
                         f"{held_bytes - limit_bytes}" + (f" ({detail})" if detail else ""))
        self.window = window
        self.owner = owner
        self.held_bytes = held_bytes
        self.limit_bytes = limit_bytes


class BoundaryError(JobFailure, RuntimeError):
    """A runtime error about one stored boundary (fields `boundary`, `micro_batch`)."""

    def __init__(self, message: str, *, boundary: int, micro_batch: int = 0) -> None:
        super().__init__(message)
        self.boundary = boundary
        self.micro_batch = micro_batch


class CheckpointNotResidentError(BoundaryError):
    """``get()`` was called for a boundary that is not fully resident in HBM.

    Typically the plan (or the engine) forgot a prefetch: the h2d fractions issued so far do not
    cover the boundary's bytes. The store never returns partial data.

    Attributes:
        boundary: boundary index.
        micro_batch: micro-batch index.
    """


class TransferOrderError(BoundaryError):
    """A transfer was issued whose source bytes are not there yet (e.g. the last nvme_write
    fraction before the d2h completed, h2d of a boundary that was never read back), or outside
    a window.

    Attributes:
        boundary: boundary index.
        micro_batch: micro-batch index.
    """
