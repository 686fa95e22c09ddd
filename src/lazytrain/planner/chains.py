"""In-window order: where a window lasts longer than its slowest channel.

The fluid window time (`window_time.window_time_ms`: the max of compute and every channel's bytes
over its bandwidth) assumes every byte of a window can move at any moment of it. Two things the
engine does in one window break that assumption, because each stream is a FIFO and some work
waits for other work *of the same window* to end:

1. A boundary's chained transfers. The runtime's NVMe write of a boundary waits for the whole
   D2H of that boundary issued so far (the IO thread synchronizes the D2H event), its NVMe read
   for every write of the boundary, and its H2D for every read. So a chained transfer issued in
   the same window as its source does not pipeline with it: it starts after the source's whole
   transfer has ended, and the source itself queues behind what was issued before it on its
   stream (the gradient drain, earlier boundaries' transfers). The MILP and the schedulers put
   a chained transfer in a later window than its source (no same-window pipelining); the
   scheduler falls back to the same window only when no later legal window exists (very short
   models), and then this module charges the serial chain.
2. Segment recompute behind its weight loads. In the window b{e-1} that ends segment (s, e) the
   H2D stream carries, in issue order, the window's activation prefetches, the next block's
   weights P[j-1], then P[s], P[s+1], ..., P[e-2]; the recompute forward of block k starts only
   when P[k] has arrived (the loads are double-buffered, so P[k+1] moves while block k runs).
   Hence t >= X / bw_h2d + max_k (sum_{q=s}^{k} P[q] / bw_h2d + sum_{q=k}^{e-2} F[q])
   + Fr[e-1] (unless kept) + B[e-1], with X the H2D bytes issued before the recompute loads.

Both are exact for the event simulator (`sim/`) up to duplex sharing (a D2H and an H2D copy
that together exceed the duplex cap share it; the fluid (H2D + D2H) / bw_duplex term is kept).
GPU only: on a CPU the window is already the sum of all its work.

A window's kinds are issued in `lazytrain.contract.TRANSFER_ORDER`, as the engine issues them
(the simulator's `sim/tasks.py` issues them the same way).

Pure Python; no solver, no torch. Index legend as in `evaluate.py`.
Source: docs/execution_model.md, "In-window order".
"""

from __future__ import annotations

from lazytrain.contract import TRANSFER_ORDER
from lazytrain.planner.windows import window_ord
from lazytrain.planner.problem import PlanningProblem

CHAIN_SOURCE = {"nvme_write": "d2h", "nvme_read": "nvme_write", "h2d": "nvme_read"}
"""Kind -> the kind of the same boundary it waits for when both run in one window (an h2d of a
dram-tier boundary waits for its d2h; the planners never put the two in one window, where the
runtime would adopt the HBM copy instead)."""


def recompute_chain_ms(problem: PlanningProblem, s: int, e: int) -> float:
    """max_{k=s..e-2} (sum_{q=s}^{k} P[q] / bw_h2d + sum_{q=k}^{e-2} F[q]), ms; 0 if e - s < 2.

    The time from the end of the H2D work issued before segment (s, e)'s recompute loads to the
    end of its last recompute forward, when every forward waits for its block's weights.

    Args:
        problem: the planning problem (weights P in bytes, F in ms, bw in bytes/s).
        s, e: the segment's ends, 0 <= s < e <= L.
    """
    if e - s < 2:
        return 0.0
    bw_ms = problem.h2d_bytes_per_s / 1e3
    best, loaded = 0.0, 0.0
    load_bytes = problem.load_bytes  # a property: read once
    for k in range(s, e - 1):
        loaded += load_bytes[k] / bw_ms
        best = max(best, loaded + sum(problem.fwd_ms[k:e - 1]))
    return best


def stream_bounds_ms(problem: PlanningProblem, tiers, transfers, *, keep_internals=(),
                     resident_weights=(), saved_h2d_bytes=None) -> list[float]:
    """Per window ord, the FIFO-stream lower bound on its time (module docstring), ms.

    Streams in issue order (runtime/engine.py, sim/tasks.py): d2h = [gradient drain G[j+1] in
    b{j}] + the window's d2h transfers; nvme_write, nvme_read; h2d = the window's h2d transfers
    + the next weight load (+ the recompute loads in a segment's last window) + the saved
    internals' h2d (`saved_h2d_bytes`). Transfers of one
    kind run in boundary order. A transfer whose source kind of the same boundary runs in the
    same window starts after that source's end.

    Args:
        problem: the planning problem.
        tiers: tier per boundary (len L + 1).
        transfers: the plan's transfers (`plan.Transfer`).
        keep_internals, resident_weights: block indices.
        saved_h2d_bytes: per window ord, the saved internals' h2d bytes (save levels, dram
            tier), queued last on the H2D stream, after the recompute loads; None: none.

    Returns:
        list of 2L + 1 floats (0.0 everywhere on a CPU, where the window is a sum anyway).
    """
    p, L = problem, problem.num_blocks
    n = 2 * L + 1
    if not p.copies_overlap_compute:
        return [0.0] * n
    keep, resident = set(keep_internals), set(resident_weights)
    rank = {k: r for r, k in enumerate(TRANSFER_ORDER)}
    by_ord: dict[int, list] = {}
    for t in transfers:
        by_ord.setdefault(window_ord(t.window, L), []).append(t)
    seg_of_last = _segments_by_last_block(tiers)
    bw = {"d2h": p.d2h_bytes_per_s, "nvme_write": p.nvme_write_bytes_per_s,
          "nvme_read": p.nvme_read_bytes_per_s, "h2d": p.h2d_bytes_per_s}
    out = []
    load_bytes, drain_bytes = p.load_bytes, p.drain_bytes  # properties: read once, not per window
    reforward = p.reforward
    for o in range(n):
        ends: dict[tuple[int, str], float] = {}
        free = {k: 0.0 for k in TRANSFER_ORDER}
        j = 2 * L - o if o > L else None
        if j is not None and j + 1 <= L - 1:
            free["d2h"] = drain_bytes[j + 1] / bw["d2h"] * 1e3
        for t in sorted(by_ord.get(o, ()), key=lambda t: (rank[t.kind], t.boundary)):
            start = free[t.kind]
            src = CHAIN_SOURCE.get(t.kind)
            if t.kind == "h2d" and tiers[t.boundary] == "dram":
                src = "d2h"
            if src is not None:
                start = max(start, ends.get((t.boundary, src), 0.0))
            free[t.kind] = start + p.boundary_bytes[t.boundary] * t.fraction / bw[t.kind] * 1e3
            ends[t.boundary, t.kind] = free[t.kind]
        h2d = free["h2d"] + _next_load_bytes(load_bytes, L, o, resident) / bw["h2d"] * 1e3
        bound = max(free["d2h"], free["nvme_write"], free["nvme_read"], h2d)
        s, e = seg_of_last.get(j, (0, 0))
        if e - s >= 2:  # block j ends a segment with recompute
            tail = p.bwd_ms[j] + (0.0 if j in keep else reforward[j])
            bound = max(bound, h2d + recompute_chain_ms(p, s, e) + tail)
        if saved_h2d_bytes is not None and saved_h2d_bytes[o] > 0:  # behind every load
            loads = sum(load_bytes[s:e - 1]) if e - s >= 2 else 0.0
            bound = max(bound, h2d + (loads + saved_h2d_bytes[o]) / bw["h2d"] * 1e3)
        out.append(bound)
    return out


def _segments_by_last_block(tiers) -> dict[int, tuple[int, int]]:
    """{e - 1: (s, e)} for every segment (boundary 0 and each materialized boundary start one)."""
    starts = [0] + [i for i in range(1, len(tiers)) if tiers[i] != "recompute"]
    return {e - 1: (s, e) for s, e in zip(starts[:-1], starts[1:])}


def _next_load_bytes(load_bytes, L: int, o: int, resident: set) -> float:
    """The weight load issued after a window's transfers: f{j}: P[j+1]; turn: P[L-1]; b{j}:
    P[j-1] (resident blocks' backward loads are skipped), bytes; `load_bytes` is
    `problem.load_bytes` of the L blocks."""
    if o < L:
        return float(load_bytes[o + 1]) if o + 1 < L else 0.0
    if o == L:
        return 0.0 if L - 1 in resident else float(load_bytes[L - 1])
    j = 2 * L - o
    return float(load_bytes[j - 1]) if j >= 1 and j - 1 not in resident else 0.0


def recompute_terms(problem: PlanningProblem, tiers, keep_internals=()
                    ) -> tuple[list[float], list[float]]:
    """Per window ord: (R[s,e] + Fr[j] (unless kept) + B[j], ms; recompute load bytes) for the
    window b{j} ending a segment (s, j + 1) with recompute, (0, 0) elsewhere.

    With them a window's recompute bound is `recompute_bound_ms` of its total H2D bytes; the
    heuristics' incremental scoring uses this form (the schedulers never chain NVMe transfers
    in one window, so it equals `stream_bounds_ms` on their plans).
    """
    p, L = problem, problem.num_blocks
    keep = set(keep_internals)
    rec_ms, rec_bytes = [0.0] * (2 * L + 1), [0.0] * (2 * L + 1)
    for j, (s, e) in _segments_by_last_block(tiers).items():
        if e - s >= 2:
            o = 2 * L - j
            rec_ms[o] = (recompute_chain_ms(p, s, e) + p.bwd_ms[j]
                         + (0.0 if j in keep else p.reforward[j]))
            rec_bytes[o] = float(sum(p.load_bytes[s:e - 1]))
    return rec_ms, rec_bytes


def recompute_bound_ms(problem: PlanningProblem, h2d_bytes: float, rec_ms: float,
                       rec_bytes: float) -> float:
    """(h2d_bytes - rec_bytes) / bw_h2d + rec_ms, ms (0 without recompute or on a CPU)."""
    if rec_ms <= 0.0 or not problem.copies_overlap_compute:
        return 0.0
    return (h2d_bytes - rec_bytes) / problem.h2d_bytes_per_s * 1e3 + rec_ms
