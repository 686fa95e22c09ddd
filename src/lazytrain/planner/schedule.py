"""The transfer scheduler: a legal, window-filling transfer schedule for a tier assignment.

Owns `Loads` (per-window compute and channel bytes while a schedule is built, with the window
time of the fluid model plus the recompute-order term of `planner/chains.py`) and the greedy
placement of each boundary's d2h, NVMe write, NVMe read and h2d (`schedule_transfers`), used by
`evaluate.decisions_from_tiers`, the heuristics and tests. A chained NVMe transfer goes to a
later window than its source (docs/execution_model.md, "In-window order").

Pure Python; no solver, no torch. Index legend as in `planner/windows.py`.
"""

from __future__ import annotations

from lazytrain.planner.chains import recompute_bound_ms, recompute_terms
from lazytrain.planner.duplex import effective_cap
from lazytrain.planner.plan import Transfer
from lazytrain.planner.problem import PlanningProblem
from lazytrain.planner.window_time import (
    fixed_loads, host_by_window_ms, host_loads_ms, window_time_ms,
)
from lazytrain.planner.windows import (
    OFFLOAD_TIERS, TRANSFER_KINDS, check_tiers, horizons_of, legal_ords, segment_ends, use_ord,
    window_name,
)

_EPS = 1e-9
"""Fractions below this are dropped by the scheduler (dimensionless)."""

class Loads:
    """Per-window compute (ms) and channel bytes while a schedule is being built."""

    def __init__(self, problem: PlanningProblem, comp, h2d, d2h, rec=None, host=None) -> None:
        n = len(comp)
        self.p, self.comp = problem, comp
        self.chan = {"h2d": h2d, "d2h": d2h, "nvme_read": [0.0] * n, "nvme_write": [0.0] * n}
        self.rec_ms, self.rec_bytes = rec if rec is not None else ([0.0] * n, [0.0] * n)
        """`chains.recompute_terms`: the recompute-behind-its-weights bound per window."""
        self.host = host if host is not None else host_loads_ms(problem, [0.0] * n, d2h)
        """Host ms per window (`window_time.host_loads_ms`): by default the gradient drains of
        `d2h` only (no weight conversion); `schedule_loads` passes the plan's."""

    def time_ms(self, o: int, kind: str | None = None, extra: float = 0.0) -> float:
        """Window o's time with `extra` bytes of `kind` added (fluid max + recompute order)."""
        c = self.chan
        loads = {k: c[k][o] for k in TRANSFER_KINDS}
        if kind is not None:
            loads[kind] += extra
        return max(window_time_ms(self.p, self.comp[o], loads["h2d"], loads["d2h"],
                                  loads["nvme_read"], loads["nvme_write"], self.host[o]),
                   recompute_bound_ms(self.p, loads["h2d"], self.rec_ms[o], self.rec_bytes[o]))

    def slack_bytes(self, kind: str, o: int) -> float:
        """Bytes of `kind` that fit in window o without lengthening it (0 on a CPU)."""
        p, c = self.p, self.chan
        if not p.copies_overlap_compute:
            return 0.0
        t_s = self.time_ms(o) / 1e3
        cap = effective_cap(p.h2d_bytes_per_s, p.d2h_bytes_per_s, p.duplex_bytes_per_s)
        duplex = cap * t_s - c["h2d"][o] - c["d2h"][o]
        h2d_room = p.h2d_bytes_per_s * t_s - c["h2d"][o]
        if self.rec_ms[o] > 0:  # the recompute waits behind every H2D byte before its loads
            h2d_room = min(h2d_room, p.h2d_bytes_per_s * (t_s - self.rec_ms[o] / 1e3)
                           - (c["h2d"][o] - self.rec_bytes[o]))
        room = {"h2d": min(h2d_room, duplex),
                "d2h": min(p.d2h_bytes_per_s * t_s - c["d2h"][o], duplex),
                "nvme_read": p.nvme_read_bytes_per_s * t_s - c["nvme_read"][o],
                "nvme_write": p.nvme_write_bytes_per_s * t_s - c["nvme_write"][o]}[kind]
        return max(0.0, room)

    def fill(self, kind: str, nbytes: float, ords: list[int]) -> dict[int, float]:
        """Place fraction 1 of a transfer over `ords` (in preference order) and return it.

        Phase 1 fills each window's slack in order; phase 2 puts what is left into the window
        whose time grows least (ties: the earlier in `ords`).
        """
        placed = [0.0] * len(ords)
        rem = 1.0
        for k, o in enumerate(ords):
            x = min(rem, self.slack_bytes(kind, o) / nbytes) if nbytes > 0 else rem
            if x > _EPS:
                placed[k] += x
                rem -= x
            if rem <= _EPS:
                break
        if rem > _EPS:
            base = [self.time_ms(o) for o in ords]
            growth = [self.time_ms(o, kind, rem * nbytes) - t for o, t in zip(ords, base)]
            least = min(growth)
            # equal growths tie to the earlier window; the tolerance scales with the window
            # times, whose rounding differs between a full and an incremental evaluation
            tol = 1e-12 + 1e-12 * max(abs(t) for t in base)
            placed[next(k for k, g in enumerate(growth) if g <= least + tol)] += rem
        out = {}
        for k, x in enumerate(placed):
            if x > _EPS:
                out[ords[k]] = x
                self.chan[kind][ords[k]] += x * nbytes
        total = sum(out.values())
        return {o: x / total for o, x in out.items()}

    def fill_whole(self, kind: str, nbytes: float, ords: list[int]) -> dict[int, float]:
        """Place a whole transfer in one window of `ords` and return {ord: 1.0}.

        The first window (in preference order) whose slack takes it all, else the window whose
        time grows least (ties: the earlier in `ords`). D2H and H2D are scheduled whole, as the
        MILP moves them (planner/milp_vars.py WHOLE_TRANSFERS): the runtime holds a boundary in HBM
        until its last D2H byte and from its first H2D byte, so a split only costs HBM.
        """
        fits = [o for o in ords if self.slack_bytes(kind, o) >= nbytes]
        if fits:
            chosen = fits[0]
        else:
            base = [self.time_ms(o) for o in ords]
            growth = [self.time_ms(o, kind, nbytes) - t for o, t in zip(ords, base)]
            least = min(growth)
            tol = 1e-12 + 1e-12 * max(abs(t) for t in base)  # as in `fill`
            chosen = ords[next(k for k, g in enumerate(growth) if g <= least + tol)]
        self.chan[kind][chosen] += nbytes
        return {chosen: 1.0}


def schedule_offload(loads: Loads, problem: PlanningProblem, i: int, tier: str,
                     segment_end: int) -> dict[str, dict[int, float]]:
    """d2h as soon as possible, then (nvme tier) NVMe writes from the next window on (the d2h's
    window only when no later one is legal); updates `loads`."""
    A = float(problem.boundary_bytes[i])
    out = {"d2h": loads.fill_whole("d2h", A, _ords(problem, "d2h", i, segment_end))}
    if tier == "nvme":
        d2h, use = max(out["d2h"]), use_ord(segment_end, problem.num_blocks)
        later = _later_ords(problem, "nvme_write", i, segment_end, d2h)
        # leave a window for the read and one for the h2d before `use` where the model has them
        ords = [o for o in later if o <= use - 3] or later
        out["nvme_write"] = loads.fill("nvme_write", A, ords)
    return out


def schedule_prefetch(loads: Loads, problem: PlanningProblem, i: int, tier: str,
                      segment_end: int, offload: dict[str, dict[int, float]]
                      ) -> dict[str, dict[int, float]]:
    """h2d as late as possible (after the last d2h / NVMe write), NVMe reads in windows before
    it (in the h2d's window only when no earlier read window is legal)."""
    A = float(problem.boundary_bytes[i])
    if tier == "dram":
        lo = max(offload["d2h"])
        return {"h2d": loads.fill_whole("h2d", A,
                                        _later_ords(problem, "h2d", i, segment_end, lo)[::-1])}
    read_ords = _later_ords(problem, "nvme_read", i, segment_end, max(offload["nvme_write"]))
    h2d = loads.fill_whole("h2d", A, _later_ords(problem, "h2d", i, segment_end,
                                                 read_ords[0])[::-1])
    (h,) = h2d
    before = [o for o in read_ords if o < h] or [o for o in read_ords if o <= h]
    return {"h2d": h2d, "nvme_read": loads.fill("nvme_read", A, before[::-1])}


def _later_ords(problem: PlanningProblem, kind: str, i: int, segment_end: int, source: int
                ) -> list[int]:
    """Legal ords of a chained transfer after its source's window `source` (no same-window
    pipelining, docs/execution_model.md "In-window order"); when no later window is legal (a
    boundary near the end of a short model), the source's window is allowed too."""
    return ([o for o in _ords(problem, kind, i, segment_end, source) if o > source]
            or _ords(problem, kind, i, segment_end, source))


def _ords(problem: PlanningProblem, kind: str, i: int, segment_end: int, lo: int = 0
          ) -> list[int]:
    hz = horizons_of(problem)
    r = [o for o in legal_ords(kind, i, segment_end, problem.num_blocks, **hz) if o >= lo]
    if not r:
        raise ValueError(f"boundary {i}: no legal window for its {kind} within the horizons {hz}"
                         f" (segment ({i}, {segment_end}), needed in b{segment_end - 1})")
    return r


def schedule_loads(problem: PlanningProblem, tiers, keep_internals=(), resident_weights=None
                   ) -> tuple[dict[int, dict[str, dict[int, float]]], Loads]:
    """The schedule as {boundary: {kind: {ord: fraction}}} and the resulting window loads."""
    L = problem.num_blocks
    tiers = check_tiers(problem, tiers)
    comp, h2d, d2h = fixed_loads(problem, tiers, keep_internals, resident_weights)
    resident = keep_internals if resident_weights is None else resident_weights
    loads = Loads(problem, comp, h2d, d2h, rec=recompute_terms(problem, tiers, keep_internals),
                  host=host_by_window_ms(problem, tiers, resident, d2h))
    ends = segment_ends(tiers)
    offloaded = [i for i in range(L) if tiers[i] in OFFLOAD_TIERS]
    sched = {i: schedule_offload(loads, problem, i, tiers[i], ends[i]) for i in offloaded}
    for i in sorted(offloaded, key=lambda i: use_ord(ends[i], L)):
        sched[i].update(schedule_prefetch(loads, problem, i, tiers[i], ends[i], sched[i]))
    return sched, loads


def schedule_transfers(problem: PlanningProblem, tiers, keep_internals=(), *,
                       resident_weights=None) -> tuple[Transfer, ...]:
    """A legal transfer schedule for a tier assignment, within the problem's horizons.

    Offloads in production order: d2h as soon as possible, whole in one window (the first whose
    slack takes it, else the window that grows least), NVMe writes from the window after the
    d2h. Prefetches by earliest deadline first: h2d as late as possible, NVMe reads in the
    windows before it. A chained transfer never shares its source's window unless no later
    window is legal (docs/execution_model.md, "In-window order"), so precedence holds by
    construction. On a CPU (no slack) everything lands in one window: d2h at production, h2d
    just before use, which keeps HBM holding intervals shortest.

    Raises:
        ValueError: malformed tiers, or a transfer without any legal window.
    """
    L = problem.num_blocks
    sched, _ = schedule_loads(problem, tiers, keep_internals, resident_weights)
    return tuple(Transfer(boundary=i, kind=kind, window=window_name(o, L), fraction=x)
                 for i in sorted(sched) for kind in sorted(sched[i])
                 for o, x in sorted(sched[i][kind].items()))
