"""Host staging buffers of the NVMe tier, window by window, as the runtime holds them.

An NVMe-tier boundary passes through one pinned DRAM buffer, padded to the 4 KiB O_DIRECT
block, twice (runtime/activations.py):
- on the way out, from the window of its first d2h fraction until the window barrier after its
  last nvme_write fraction (the buffer is released there);
- on the way back, from the window of its first nvme_read fraction until the barrier of the
  window where its last h2d fraction completes;
- when the read starts before the write-side release, the same buffer is kept throughout.

`staging_by_window` gives the padded bytes held in each window (ord 0..2L); its maximum goes
into the plan's predicted pinned bytes (`Predicted.pinned_bytes`). The DRAM row of the MILP and
the evaluator budgets a constant pool instead (`lazytrain.contract` `NVME_BOUNCE_BUFFERS`).
The padding is the contract's `align_up` (ALIGN_BYTES, the runtime's O_DIRECT alignment).
Pure Python, no torch.
"""

from __future__ import annotations

from lazytrain.contract import align_up
from lazytrain.planner.plan import window_ord


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
        spans = []
        out_start, out_end = first.get((i, "d2h")), last.get((i, "nvme_write"))
        back_start, back_end = first.get((i, "nvme_read")), last.get((i, "h2d"))
        if None in (out_start, out_end, back_start, back_end):
            continue  # an incomplete schedule: the plan's validation reports it
        if back_start <= out_end:  # read began before the write-side release: one buffer
            spans.append((out_start, max(out_end, back_end)))
        else:
            spans += [(out_start, out_end), (back_start, back_end)]
        for a, b in spans:
            for o in range(a, b + 1):
                held[o] += align_up(boundary_bytes[i])
    return held
