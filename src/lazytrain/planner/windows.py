"""The plan's index space: tier and transfer vocabulary, window names and ords, the legal
windows of each transfer (and the horizons that bound them), and the recompute segments of a
tier assignment.

Shared by the Plan JSON (`planner/plan.py`), its checks (`planner/plan_checks.py`), the
evaluator, the scheduler and the MILP, so each spells a window and a legal window the same way.
Knows no solver and no torch; the runtime may import it.

Index legend: block j = 0..L-1 maps boundary j to boundary j+1; boundary i = 0..L; windows
f0..f{L-1} (ord j), turn (ord L), b{L-1}..b0 (ord 2L - j).

Source: docs/execution_model.md, "Transfers and their legal windows".
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lazytrain.contract import TURN_WINDOW, backward_window, forward_window

if TYPE_CHECKING:  # read for its fields only; keeps this module a leaf the runtime may import
    from lazytrain.planner.problem import PlanningProblem

TIERS = ("hbm", "dram", "nvme", "recompute")
"""Tier vocabulary; a boundary that is not materialized has tier `recompute`."""
OFFLOAD_TIERS = ("dram", "nvme")
"""Tiers whose boundaries leave HBM after the forward and come back before use."""
TRANSFER_KINDS = ("d2h", "h2d", "nvme_write", "nvme_read")
"""Transfer kinds: HBM->DRAM, DRAM->HBM, DRAM->NVMe file, NVMe file->DRAM."""
SAVE_LEVELS = ("L0", "L1", "L2")
"""What a block keeps from f{j} for b{j} (Plan JSON `save_levels`): L0 nothing beyond its input
boundary (truncated re-forward), L1 the token mixer's side (the rest re-forwarded), L2 every
tensor its backward reads (no re-forward). docs/execution_model.md, "Save levels"."""
SAVED_TIERS = ("none", "hbm", "dram")
"""Where an L1/L2 block's saved internals wait for b{j} (Plan JSON `saved_tiers`): "none" for
an L0 or kept block; "hbm" held on the device; "dram" drained D2H and prefetched H2D."""
INTERNAL_TRANSFER_KINDS = ("d2h", "h2d")
"""Transfer kinds of a dram-tier block's saved internals (no NVMe: wear)."""


def window_names(num_blocks: int) -> list[str]:
    """Window names in execution order: f0..f{L-1}, turn, b{L-1}..b0 (2L+1 names; spelled by
    `lazytrain.contract`, as the engine names the windows it runs)."""
    return [window_name(o, num_blocks) for o in range(2 * num_blocks + 1)]


def window_ord(name: str, num_blocks: int) -> int:
    """Position of a window in execution order: f{j} -> j, turn -> L, b{j} -> 2L - j.

    Raises:
        ValueError: if the name is not a window of an L-block plan.
    """
    L = num_blocks
    if name == TURN_WINDOW:
        return L
    if len(name) >= 2 and name[0] in "fb" and name[1:].isdigit():
        j = int(name[1:])
        if 0 <= j < L and str(j) == name[1:]:
            return j if name[0] == "f" else 2 * L - j
    raise ValueError(f"unknown window {name!r} for {L} blocks; expected f0..f{L - 1}, turn, "
                     f"b{L - 1}..b0")


def window_name(ord_: int, num_blocks: int) -> str:
    """Inverse of `window_ord`.

    Raises:
        ValueError: if `ord_` is outside 0..2L.
    """
    L = num_blocks
    if not 0 <= ord_ <= 2 * L:
        raise ValueError(f"window ord {ord_} outside 0..{2 * L}")
    if ord_ < L:
        return forward_window(ord_)
    if ord_ == L:
        return TURN_WINDOW
    return backward_window(2 * L - ord_)


def use_ord(segment_end: int, num_blocks: int) -> int:
    """ord of b{e-1}, the window where the start of segment (s, e) is first needed: 2L - e + 1."""
    return 2 * num_blocks - segment_end + 1


def legal_ords(kind: str, boundary: int, segment_end: int, num_blocks: int, *,
               drain_windows: int | None, prefetch_windows: int | None,
               nvme_lead_windows: int | None) -> range:
    """Window ords in which a transfer of `kind` for `boundary` may run (the contract's table).

    With `use = 2L - e + 1` (segment (boundary, e)) and H_d, H_p, H_n the horizons:
      d2h:        i <= ord <= i + H_d - 1,          ord < use
      nvme_write: i <= ord <= i + H_d + H_n - 1,    ord < use
      nvme_read:  use - H_p - H_n <= ord <= use - 1  (and ord >= i)
      h2d:        use - H_p <= ord <= use - 1        (and ord >= i)
    A horizon of None means unlimited (only the order constraints i <= ord < use remain).

    Args:
        kind: one of TRANSFER_KINDS.
        boundary: i, 0..L-1.
        segment_end: e, the next materialized boundary after i.
        num_blocks: L.

    Returns:
        range of ords (possibly empty).

    Raises:
        ValueError: unknown kind.

    Source: docs/execution_model.md, "Transfers and their legal windows".
    """
    i = boundary
    use = use_ord(segment_end, num_blocks)
    h_d, h_p, h_n = drain_windows, prefetch_windows, nvme_lead_windows
    if kind == "d2h":
        hi = use - 1 if h_d is None else min(use - 1, i + h_d - 1)
        return range(i, hi + 1)
    if kind == "nvme_write":
        hi = use - 1 if h_d is None or h_n is None else min(use - 1, i + h_d + h_n - 1)
        return range(i, hi + 1)
    if kind == "nvme_read":
        lo = i if h_p is None or h_n is None else max(i, use - h_p - h_n)
        return range(lo, use)
    if kind == "h2d":
        lo = i if h_p is None else max(i, use - h_p)
        return range(lo, use)
    raise ValueError(f"unknown transfer kind {kind!r}; expected one of {TRANSFER_KINDS}")


def internal_legal_ords(kind: str, block: int, num_blocks: int, *, drain_windows: int | None,
                        prefetch_windows: int | None) -> range:
    """Window ords in which a transfer of a dram-tier block's saved internals may run.

    d2h: j + 1 <= ord <= min(j + H_d, 2L - j - 1); h2d: 2L - j - H_p <= ord <= 2L - j - 1
    (and ord >= j + 1). A horizon of None means unlimited. Every h2d must also come strictly
    after every d2h of the block (`plan_checks`), so a block with no legal pair (j = L - 1)
    cannot take the dram tier.

    Args:
        kind: "d2h" or "h2d".
        block: j, 0..L-1.
        num_blocks: L.

    Returns:
        range of ords (possibly empty).

    Raises:
        ValueError: unknown kind.

    Source: docs/execution_model.md, "Save levels".
    """
    j, L = block, num_blocks
    use = 2 * L - j  # ord of b{j}, where the internals are read
    if kind == "d2h":
        hi = use - 1 if drain_windows is None else min(use - 1, j + drain_windows)
        return range(j + 1, hi + 1)
    if kind == "h2d":
        lo = j + 1 if prefetch_windows is None else max(j + 1, use - prefetch_windows)
        return range(lo, use)
    raise ValueError(f"unknown internal transfer kind {kind!r}; expected one of "
                     f"{INTERNAL_TRANSFER_KINDS}")


def horizons_of(problem: PlanningProblem) -> dict:
    """The transfer horizons as stored in plan provenance["horizons"]."""
    return {"drain_windows": problem.drain_windows, "prefetch_windows": problem.prefetch_windows,
            "nvme_lead_windows": problem.nvme_lead_windows}


def check_tiers(problem: PlanningProblem, tiers) -> tuple[str, ...]:
    """Tiers as a tuple after checking length, vocabulary and tier[L] == hbm.

    Raises:
        ValueError: naming the boundary.
    """
    L = problem.num_blocks
    tiers = tuple(tiers)
    if len(tiers) != L + 1:
        raise ValueError(f"tiers must have {L + 1} entries (boundaries 0..{L}); got {len(tiers)}")
    for i, t in enumerate(tiers):
        if t not in TIERS:
            raise ValueError(f"boundary {i}: tier {t!r} is not one of {TIERS}")
    if tiers[L] != "hbm":
        raise ValueError(f"boundary {L}: the last boundary must be hbm; got {tiers[L]!r}")
    return tiers


def segments_of(tiers) -> list[tuple[int, int]]:
    """Segments (s, e) in forward order: boundary 0 plus every materialized boundary start one."""
    starts = [0] + [i for i in range(1, len(tiers)) if tiers[i] != "recompute"]
    return list(zip(starts[:-1], starts[1:]))


def segment_ends(tiers) -> list[int]:
    """e of the segment containing each boundary i < L (the next materialized boundary)."""
    ends = [0] * (len(tiers) - 1)
    for s, e in segments_of(tiers):
        for k in range(s, e):
            ends[k] = e
    return ends
