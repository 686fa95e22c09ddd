"""A solver's feasibility tolerance never ships a plan over budget.

HiGHS accepts a row violated by up to its feasibility tolerance (1e-6 on rows in GB: about
1 kB), while the evaluator counts budgets to the byte. With the DRAM budget 64 B below what
the fastest plan needs, the solver's incumbent is that plan; the planner must return a plan
the evaluator finds within every budget instead.
"""

from __future__ import annotations

import pytest

from lazytrain.planner.evaluate import build_plan, decisions_from_tiers, evaluate
from lazytrain.planner.infeasible import PlanInfeasibleError
from lazytrain.planner.milp_solve import solve_milp
from lazytrain.planner.plan import SolveRecord
from lazytrain.planner.policy import PlannerOptions, plan
from test_milp import U, small_problem


def _just_short_of_all_dram():
    """small_problem with DRAM room for boundaries 0-4 in DRAM less 64 B (the all-DRAM plan,
    the fastest with that room, is 64 B over; its DRAM need is the evaluator's)."""
    roomy = small_problem(dram_bytes=(12 * (10**8 * 6 + 10**7) // U + 610) * U)
    tiers = ("dram",) * 5 + ("hbm", "hbm")
    need = evaluate(roomy, decisions_from_tiers(roomy, tiers)).dram_bytes
    problem = roomy.replace(dram_bytes=int(need) - 64)
    over = build_plan(problem, decisions_from_tiers(problem, tiers),
                      solver=SolveRecord(backend="manual"))
    assert over.provenance.get("violations"), "fixture: the all-DRAM plan must be 64 B over"
    return problem


def test_solve_milp_returns_no_plan_over_budget_by_the_solver_tolerance():
    pytest.importorskip("highspy")
    problem = _just_short_of_all_dram()
    chosen = solve_milp(problem, backend="highs", gap=1e-9, time_limit_s=30)
    assert not chosen.provenance.get("violations"), chosen.provenance.get("violations")
    assert evaluate(problem, chosen).feasible


def test_the_policy_returns_no_plan_over_budget_by_the_solver_tolerance():
    pytest.importorskip("highspy")
    problem = _just_short_of_all_dram()
    chosen = plan(problem, PlannerOptions(backend="highs", gap=1e-9, time_limit_s=30))
    assert not chosen.provenance.get("violations"), chosen.provenance.get("violations")
    assert evaluate(problem, chosen).feasible


def test_a_feasibility_solve_that_finds_nothing_names_the_start_s_shortfall():
    """The feasibility solve stops before any assignment and the start (an overflowing plan the
    model cannot express: a resident block inside a recompute segment) gave it none: the error
    is the start's shortfall with its fix (what `lazytrain plan --micro-batch 100000` needs to
    read), not 'raise planner.time_limit_s' alone. HBM room 50 u: boundary L needs 120 u."""
    pytest.importorskip("highspy")
    from dataclasses import replace

    from lazytrain.planner.feasibility import feasible_plan

    problem = small_problem(hbm_bytes=1050 * U)
    tiers = ("hbm", "recompute", "recompute", "hbm", "hbm", "hbm", "hbm")
    start = build_plan(problem, replace(decisions_from_tiers(problem, tiers),
                                        resident_weights=(1,)),
                       solver=SolveRecord(backend="manual"))
    with pytest.raises(PlanInfeasibleError) as info:
        feasible_plan(problem, backend="highs", time_limit_s=1e-9, start=start)
    err = info.value
    assert err.budget == "HBM" and not err.proven
    assert err.shortfall_bytes == pytest.approx(evaluate(problem, start).hbm_short_bytes)
