"""Host staging (bounce) buffers of the NVMe tier, window by window: what the runtime holds for
a schedule, and the bound every schedule the contract allows stays within.

An NVMe-tier boundary passes through one pinned DRAM buffer, padded to the 4 KiB O_DIRECT
block, twice (runtime/activations.py):
- on the way out, from the window of its first d2h fraction until the window barrier after its
  last nvme_write fraction (the buffer is released there);
- on the way back, from the window of its first nvme_read fraction until the barrier of the
  window where its last h2d fraction completes;
- when the read starts before the write-side release, the same buffer is kept throughout.

`staging_by_window` applies that rule to a plan's transfers: the padded bytes the runtime holds
in each window (ord 0..2L). `bounce_spans` applies it to the first and last windows the
contract allows each transfer (`windows.legal_ords`), so `bounce_bound_by_window` bounds the
buffers of every legal schedule of the same tiers: it is the one staging figure of the planner.
The MILP's DRAM rows (`milp_rows.add_dram_capacity`, per window), the evaluator's DRAM and
predicted pinned bytes (`Predicted.pinned_bytes`) take its peak in place of the contract's
constant pool (`lazytrain.contract` `NVME_BOUNCE_BUFFERS`), so a plan that fits its DRAM row
fits the runtime's pinned budget whatever the transfers inside their windows do.
The padding is the contract's `align_up` (ALIGN_BYTES, the runtime's O_DIRECT alignment).
Pure Python, no torch.
"""

from __future__ import annotations

from lazytrain.contract import align_up
from lazytrain.planner.windows import legal_ords, window_ord


def staging_by_window(boundary_bytes, tiers, transfers, num_blocks: int) -> list[int]:
    """Padded NVMe staging bytes held in each window, ord 0..2L.

    Args:
        boundary_bytes: A[i], bytes of boundary i (i = 0..L).
        tiers: tier of each boundary.
        transfers: the plan's transfers (boundary, kind, window, fraction).
        num_blocks: L.

    Returns:
        [2L + 1] bytes per window ord.
    """
    L = num_blocks
    first: dict[tuple[int, str], int] = {}
    last: dict[tuple[int, str], int] = {}
    for t in transfers:
        o = window_ord(t.window, L)
        key = (t.boundary, t.kind)
        first[key] = min(first.get(key, o), o)
        last[key] = max(last.get(key, o), o)
    held = [0] * (2 * L + 1)
    for i, tier in enumerate(tiers):
        if tier != "nvme":
            continue
        ends = (first.get((i, "d2h")), last.get((i, "nvme_write")),
                first.get((i, "nvme_read")), last.get((i, "h2d")))
        if None in ends:
            continue  # an incomplete schedule: the plan's validation reports it
        for a, b in _spans(*ends):
            for o in range(a, b + 1):
                held[o] += align_up(boundary_bytes[i])
    return held


def bounce_spans(boundary: int, segment_end: int, num_blocks: int, *, drain_windows: int | None,
                 prefetch_windows: int | None,
                 nvme_lead_windows: int | None) -> tuple[tuple[int, int], ...]:
    """Window ords (inclusive ranges) in which NVMe boundary i with segment (i, e) may hold its
    bounce buffer under any legal schedule: the module docstring's rule applied to the first
    legal d2h, the last legal nvme_write, the first legal nvme_read and the last legal h2d ord.

    Args:
        boundary: i, 0..L-1.
        segment_end: e, the next materialized boundary after i.
        num_blocks: L.
        drain_windows, prefetch_windows, nvme_lead_windows: the horizons (None: unlimited).

    Returns:
        One or two (first ord, last ord) ranges; () when some transfer has no legal window
        (the boundary cannot be on NVMe with this segment end).
    """
    horizons = {"drain_windows": drain_windows, "prefetch_windows": prefetch_windows,
                "nvme_lead_windows": nvme_lead_windows}
    legal = [legal_ords(kind, boundary, segment_end, num_blocks, **horizons)
             for kind in ("d2h", "nvme_write", "nvme_read", "h2d")]
    if not all(legal):
        return ()
    d2h, write, read, h2d = legal
    return _spans(d2h[0], write[-1], read[0], h2d[-1])


def bounce_bound_by_window(boundary_bytes, tiers, num_blocks: int, horizons: dict) -> list[int]:
    """Padded NVMe bounce bytes per window, ord 0..2L, that no legal schedule of `tiers`
    exceeds: align_up(A[i]) in every window of `bounce_spans(i, e)` of each NVMe boundary i
    with segment end e.

    Args:
        boundary_bytes: A[i], bytes (i = 0..L).
        tiers: tier of each boundary (L + 1 entries).
        num_blocks: L.
        horizons: {"drain_windows", "prefetch_windows", "nvme_lead_windows"} (None: unlimited).

    Returns:
        [2L + 1] bytes per window ord.
    """
    L = num_blocks
    held = [0] * (2 * L + 1)
    for i, tier in enumerate(tiers[:L]):
        if tier != "nvme":
            continue
        e = next(k for k in range(i + 1, L + 1) if tiers[k] != "recompute" or k == L)
        for a, b in bounce_spans(i, e, L, **horizons):
            for o in range(a, b + 1):
                held[o] += align_up(boundary_bytes[i])
    return held


def _spans(out_start: int, out_end: int, back_start: int,
           back_end: int) -> tuple[tuple[int, int], ...]:
    """The windows one boundary's buffer is held, from its four end points (module docstring)."""
    if back_start <= out_end:  # read began before the write-side release: one buffer
        return ((out_start, max(out_end, back_end)),)
    return ((out_start, out_end), (back_start, back_end))
