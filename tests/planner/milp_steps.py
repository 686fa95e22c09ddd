"""The MILP's step for a problem at two points: the all-HBM plan as its start and its optimum;
shared by the tests that check the MILP prices a hand-computed window as the evaluator does."""

from __future__ import annotations

import pytest

from lazytrain.planner.evaluate import Decisions, build_plan
from lazytrain.planner.extract import extract_plan, start_from_plan
from lazytrain.planner.gaps import solve_record
from lazytrain.planner.milp import build_milp
from lazytrain.planner.plan import SolveRecord
from lazytrain.planner.solvers import solve


def all_hbm_and_optimum(problem, tiers: tuple[str, ...]):
    """(milp, step ms of the MILP at the plan of `tiers`, the solved values); asserts that the
    extracted plan's predicted step equals the MILP's objective at the optimum (HiGHS,
    gap 1e-9)."""
    milp = build_milp(problem, tie_breakers=False)
    x = start_from_plan(milp, build_plan(problem, Decisions(tiers=tiers),
                                         solver=SolveRecord(backend="manual")))
    res = solve(milp.model, backend="highs", gap=1e-9, time_limit_s=30)
    plan = extract_plan(milp, res.values, solver=solve_record(milp, res))
    assert milp.step_ms(res.values) == pytest.approx(plan.predicted.step_ms, rel=1e-6)
    return milp, milp.step_ms(x), res.values
