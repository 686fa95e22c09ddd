"""Every lower bound the planner prints lies at or below every plan it returns, and the
printed gap is the returned plan's evaluated step against the best of them.

Random small problems (seeded: HBM room, H2D/D2H rates, overlap or serial copies, with or
without NVMe); the plans are the MILP's, the heuristic's and the best fixed K's, each priced by
the evaluator (the reference the bounds claim to bound).
"""

from __future__ import annotations

import random

import pytest

from lazytrain.planner.bounds import compute_bounds
from lazytrain.planner.evaluate import evaluate
from lazytrain.planner.heuristics import best_fixed_k_plan, heuristic_plan
from lazytrain.planner.milp_solve import solve_milp
from test_milp import U, small_problem


def _scenario(seed: int):
    rng = random.Random(seed)
    return small_problem(L=8, copies_overlap_compute=rng.random() < 0.7,
                         hbm_bytes=rng.choice((1300, 1500, 1800, 2500)) * U,
                         h2d_bytes_per_s=rng.choice((1e3, 3e3, 1e4)) * U,
                         d2h_bytes_per_s=rng.choice((3e3, 1e4, 5e4)) * U,
                         nvme_bytes=rng.choice((0, 400)) * U)


@pytest.mark.parametrize("seed", range(6))
def test_no_bound_exceeds_a_returned_plan_and_the_gap_is_against_the_best_bound(seed):
    pytest.importorskip("highspy")
    problem = _scenario(seed)
    bounds = compute_bounds(problem)
    heur = heuristic_plan(problem)
    plan = solve_milp(problem, warm_start=heur, bounds=bounds, gap=1e-6, time_limit_s=30)
    plans = [p for p in (plan, heur, best_fixed_k_plan(problem)) if p is not None]
    steps = [evaluate(problem, p).step_ms for p in plans if evaluate(problem, p).feasible]
    claimed = {name: getattr(bounds, name) for name in
               ("lp_step_ms", "memory_step_ms", "roofline_step_ms")}
    for name, bound in claimed.items():
        if bound is not None:
            assert bound <= min(steps) * (1 + 1e-9), (name, bound, min(steps))
    best = max(b for b in claimed.values() if b is not None)
    step = evaluate(problem, plan).step_ms
    assert plan.predicted.step_ms == pytest.approx(step, rel=1e-12)
    # the solver's own dual bound may be better (higher) than the claimed ones, never above
    # the plan: the gap lies in [0, gap against the claimed bounds]
    assert -1e-9 <= plan.solver.gap <= (step - best) / best + 1e-12
