"""Queue first, wait later: host waits on the engine's thread before a window's first compute op.

On a GPU the engine's thread only queues kernels; the device runs them later. A host wait (an
event synchronize, a wait for a worker's job) made in a window before that window's kernels
are queued leaves the GPU idle for the whole wait: the window then costs `wait + compute`
where the plan charges `max(...)` of the two. Queued first, the kernels run while the host
waits. `QueueFirstAudit` records, per window, every host wait of the engine's thread that comes
before the window's first compute op (the `cpu-checked` backend calls it from its compute-op
log and its waits); a correct engine leaves `early_waits` empty. Waits outside every window
(the step's start and end) are not counted.

A window is told apart from the next by its name (`window_of()`, the ledger's open window):
the engine never opens the same window twice in a row.

Knows nothing about plans, streams or the engine.
"""

from __future__ import annotations

from typing import Callable

from lazytrain.runtime.ledger import OUTSIDE


class QueueFirstAudit:
    """Per window: host waits made before its first compute op (see the module docstring).

    Args:
        window_of: the name of the window open now (the ledger's `window`; `OUTSIDE` between
            windows).
    """

    def __init__(self, window_of: Callable[[], str]) -> None:
        self.window_of = window_of
        self._window: str | None = None
        self._queued = False
        self.early_waits: list[str] = []
        """"window: what" of each host wait that came before its window's first compute op."""

    def _current(self) -> str:
        window = self.window_of()
        if window != self._window:
            self._window, self._queued = window, False
        return window

    def compute_queued(self) -> None:
        """The engine's thread queued a compute op in the open window."""
        self._current()
        self._queued = True

    def host_wait(self, what: str) -> None:
        """The engine's thread is about to block on `what` (an event, a job)."""
        window = self._current()
        if window != OUTSIDE and not self._queued:
            self.early_waits.append(f"{window}: {what}")
