"""The NVMe tier's bounce buffers: one number in the MILP's DRAM rows, the plan's predicted pinned
bytes and the runtime's pinned limit, and no plan returned as fitting that the limit would stop.

References: the runtime's holding rule replayed over every legal whole-window schedule
(`staging.staging_by_window`, checked by hand in tests/test_contract.py), windows and padded
sizes computed by hand, and a memory model written out by hand (`with_memory`)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from lazytrain.contract import align_up
from lazytrain.planner.budgets import plan_budgets, predicted_pinned_bytes
from lazytrain.planner.evaluate import build_plan, decisions_from_tiers, evaluate
from lazytrain.planner.extract import start_from_plan
from lazytrain.planner.infeasible import PlanInfeasibleError
from lazytrain.planner.milp import build_milp
from lazytrain.planner.plan import SolveRecord, Transfer
from lazytrain.planner.windows import legal_ords, window_name
from lazytrain.planner.policy import PlannerOptions, plan
from lazytrain.planner.staging import bounce_bound_by_window, staging_by_window
from lazytrain.units import GB
from test_milp import U, small_problem

MANUAL = SolveRecord(backend="manual")
HORIZONS = {"drain_windows": 2, "prefetch_windows": 2, "nvme_lead_windows": 1}
"""small_problem's horizons."""
# small_problem boundaries: A[i] = (80 + 13 i mod 41) u = 80, 93, 106, 119, 91, 104, 117 u
TIGHT_TIERS = ("recompute", "dram", "nvme", "dram", "nvme", "hbm", "hbm")
"""DRAM tier 93 + 119 = 212 u of the 300 u room; NVMe 106 + 91 = 197 u of 200 u."""
ONE_NUMBER_TIERS = ("recompute", "nvme", "nvme", "dram", "dram", "hbm", "hbm")
"""A plan `start_from_plan` can express (its scheduled reads and prefetches never share a
window, which the MILP's precedence rows do not allow)."""


def with_memory(problem, *, dram_room_bytes: int | None = None):
    """`problem` with the provenance memory model `planner/build.py` writes, by hand: states
    12 B/param x (6 x 1e8 + 1e7) = 7.32e9 B, staging 10 u, no scratch; DRAM budget as given
    (default the problem's)."""
    states = int(12 * (sum(problem.params_per_block) + problem.ends_params))
    dram = problem.dram_bytes if dram_room_bytes is None else dram_room_bytes
    memory = {"hbm_budget_bytes": problem.hbm_bytes, "states_bytes": states,
              "staging_bytes": problem.nvme_staging_bytes, "optimizer_scratch_bytes": 0,
              "dram_free_for_checkpoints_bytes": dram - states - problem.nvme_staging_bytes}
    return dataclasses.replace(problem, provenance={"memory": memory})


def test_bounce_bound_is_the_legal_windows_by_hand():
    """L = 4, H_d = H_p = H_n = 1, boundary 1 on NVMe with segment end 2: use = 2L - e + 1 = 7;
    d2h in {1}, nvme_write in [1, 2], nvme_read in [5, 6], h2d in {6}; the read cannot start
    before the write side is released (5 > 2), so the buffer (10000 B padded to 12288) is held
    in ords 1-2 and 5-6."""
    held = bounce_bound_by_window([10_000] * 5, ("hbm", "nvme", "hbm", "hbm", "hbm"), 4,
                                  {"drain_windows": 1, "prefetch_windows": 1,
                                   "nvme_lead_windows": 1})
    assert held == [0, 12288, 12288, 0, 0, 12288, 12288, 0, 0]


def _whole_window_schedules(i: int, e: int, L: int):
    """Every schedule of NVMe boundary i (segment end e) with one window per transfer kind in
    its legal windows, each kind after its source's window (the precedence rows)."""
    d2h, write, read, h2d = (legal_ords(k, i, e, L, **HORIZONS)
                             for k in ("d2h", "nvme_write", "nvme_read", "h2d"))
    for d, w, r, h in itertools.product(d2h, write, read, h2d):
        if d < w < r < h:
            yield d, w, r, h


def test_no_legal_schedule_holds_more_bounce_buffers_than_the_bound():
    """For TIGHT_TIERS every combination of whole-window schedules of its two NVMe boundaries,
    replayed with the runtime's holding rule, stays within the bound in every window, and the
    bound's peak is reached by one of them (it is no looser than the schedules allow here)."""
    problem = small_problem()
    L, A = problem.num_blocks, problem.boundary_bytes
    bound = bounce_bound_by_window(A, TIGHT_TIERS, L, HORIZONS)
    peak = 0
    kinds = ("d2h", "nvme_write", "nvme_read", "h2d")
    for s2, s4 in itertools.product(_whole_window_schedules(2, 3, L),
                                    _whole_window_schedules(4, 5, L)):
        transfers = [Transfer(boundary=i, kind=k, window=window_name(o, L), fraction=1.0)
                     for i, sched in ((2, s2), (4, s4)) for k, o in zip(kinds, sched)]
        held = staging_by_window(A, TIGHT_TIERS, transfers, L)
        assert all(h <= b for h, b in zip(held, bound)), (s2, s4)
        peak = max(peak, max(held))
    assert peak == max(bound) == align_up(106 * U) + align_up(91 * U)


def test_a_plan_over_the_pinned_limit_is_flagged_not_passed():
    """TIGHT_TIERS fits the old DRAM row (212 u + 10 u staging beside the states), but its NVMe
    schedule holds a 91-106 u bounce buffer on top: pinned >= 212 + 10 + 91 = 313 u against the
    runtime's limit of 310 u (300 u room + 10 u staging). The plan must carry a DRAM violation;
    before, it came back clean and the ledger would have stopped it mid-step."""
    problem = with_memory(small_problem())
    p = build_plan(problem, decisions_from_tiers(problem, TIGHT_TIERS), solver=MANUAL)
    limit = plan_budgets(p)[1]
    assert limit == 310 * U
    assert predicted_pinned_bytes(p) > limit
    assert any(v.startswith("DRAM short") for v in p.provenance.get("violations", ()))


def test_dram_rows_predicted_pinned_and_the_limit_are_one_number():
    """For a plan with NVMe boundaries, the largest DRAM row of the MILP (start_from_plan's
    assignment) plus the constant pools is the evaluator's DRAM, the same row is the predicted
    pinned bytes, and the DRAM budget less the states is the runtime's pinned limit: predicted
    pinned - limit = DRAM - budget, byte for byte (a room of 500 u, so the plan fits).
    ONE_NUMBER_TIERS: DRAM 119 + 91 = 210 u; NVMe 93 + 106 u, both buffers held in f2, f3, b2
    and b3 (bound 199 u padded), so the largest row is 210 + 199 = 409 u."""
    base = small_problem(dram_bytes=small_problem().dram_bytes + 200 * U)
    problem = with_memory(base)
    p = build_plan(problem, decisions_from_tiers(problem, ONE_NUMBER_TIERS), solver=MANUAL)
    assert "violations" not in p.provenance
    milp = build_milp(problem)
    x = start_from_plan(milp, p)
    assert x is not None
    m = milp.model
    rows = [r for r, name in enumerate(m.row_names) if name.startswith("dram_cap[")]
    assert len(rows) > 1  # the step row and the windows a bounce buffer may cover
    top = max(m.row_activity(r, x) for r in rows) * GB
    assert top == pytest.approx(210 * U + align_up(93 * U) + align_up(106 * U), abs=1.0)
    states = 12 * (sum(problem.params_per_block) + problem.ends_params)
    ev = evaluate(problem, p)
    assert top + problem.nvme_staging_bytes + states == pytest.approx(ev.dram_bytes, abs=1.0)
    assert ev.pinned_bytes == pytest.approx(top + problem.nvme_staging_bytes, abs=1.0)
    assert ev.pinned_bytes - plan_budgets(p)[1] == pytest.approx(
        ev.dram_bytes - problem.dram_bytes, abs=1.0)


def test_the_milp_returns_no_plan_over_the_pinned_limit():
    """With the tight room, the MILP's plan keeps its predicted pinned bytes within the
    runtime's limit (it counts the bounce buffers its schedule may hold)."""
    problem = with_memory(small_problem())
    p = plan(problem, PlannerOptions(backend="highs", time_limit_s=20, lp_bound=False))
    assert "violations" not in p.provenance
    assert predicted_pinned_bytes(p) <= plan_budgets(p)[1]


def test_a_plan_the_pinned_limit_would_stop_is_not_returned():
    """A memory model whose DRAM leaves only 5 u beside the states: the runtime's pinned limit
    is 5 u, while the megatrain plan (no offload) pins the 10 u staging pools. It fits the
    problem's own DRAM budget, so it carries no violation, and the planner refuses it instead
    of returning a plan the ledger would stop mid-step."""
    problem = small_problem()
    states = int(12 * (sum(problem.params_per_block) + problem.ends_params))
    short = with_memory(problem, dram_room_bytes=states + 5 * U)
    with pytest.raises(PlanInfeasibleError, match="DRAM short by 0.05 GB"):
        plan(short, PlannerOptions(policy="megatrain", lp_bound=False))
