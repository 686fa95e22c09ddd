"""The closed-form bounds under a duplex cap below one direction's own rate.

The duplex rule (docs/execution_model.md, "Duplex sharing") raises such a cap to the faster
direction's rate: running both copies never makes the pair slower than the faster one alone.
The memory bound and the roofline must use the same cap, or they lie above plans the evaluator
prices (a cap of 0.6 x the slower rate put them up to 3.3x above the MILP's plan).
"""

from __future__ import annotations

import pytest

from lazytrain.planner.bounds import memory_bound_ms, roofline_ms
from lazytrain.planner.evaluate import decisions_from_tiers, evaluate
from test_milp import U, small_problem


@pytest.mark.parametrize("rates", [(1e3, 1e3, 0.6e3), (3e4, 1e3, 1e3)],
                         ids=["cap_below_both", "cap_at_the_slower"])
def test_memory_bound_and_roofline_stay_below_plans_when_the_cap_is_below_a_rate(rates):
    """Copy-bound GPU windows (slow links): every plan's step is set by the copies."""
    h2d, d2h, cap = rates
    problem = small_problem(h2d_bytes_per_s=h2d * U, d2h_bytes_per_s=d2h * U,
                            duplex_bytes_per_s=cap * U,
                            hbm_bytes=10**13, dram_bytes=10**13, nvme_bytes=10**13)
    L = problem.num_blocks
    plans = [decisions_from_tiers(problem, ("hbm",) * (L + 1), keep_internals=range(L)),
             decisions_from_tiers(problem, ("hbm",) * (L + 1)),
             decisions_from_tiers(problem, ("dram",) * L + ("hbm",))]
    fastest = min(evaluate(problem, d).step_ms for d in plans)
    assert memory_bound_ms(problem) <= fastest * (1 + 1e-9)
    assert roofline_ms(problem) <= fastest * (1 + 1e-9)


@pytest.mark.parametrize("kind", ["h2d", "d2h"])
def test_the_scheduler_fills_an_idle_window_at_the_own_rate_under_a_low_cap(kind):
    """An idle 100 ms window holds what one copy moves alone at 1e4 u/s: 1000 u (by hand). The
    scheduler's room used the raw 0.5e4 u/s cap and offered 500 u, so it spread transfers
    over windows they did not need."""
    from lazytrain.planner.schedule import Loads

    problem = small_problem(h2d_bytes_per_s=1e4 * U, d2h_bytes_per_s=1e4 * U,
                            duplex_bytes_per_s=0.5e4 * U)
    loads = Loads(problem, [100.0], [0.0], [0.0], host=[0.0])
    assert loads.time_ms(0) == pytest.approx(100.0)
    assert loads.slack_bytes(kind, 0) == pytest.approx(1000 * U)
