"""The MILP's per-block weight-path choice (`build_milp(free_paths=True)`) prices and chooses
like the evaluator.

1. Random plans with mixed paths: the plan's decisions and paths fixed as column bounds, the
   solver's objective equals the evaluator's step of the plan it returns, and the plan's own
   assignment (`start_from_plan`) prices it as the evaluator does.
2. Brute force on 3 blocks: the free-path optimum equals the best over all 27 per-block path
   vectors of the fixed-path model's optimum (each fixed-path model is priced against the
   evaluator in test_milp_prices_plans.py), and its plan evaluates to that step.
3. `solve_milp` on the planner's problem finds a per-block mix no whole-model candidate is.
"""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from lazytrain.contract import WEIGHT_PATH_NAMES
from lazytrain.planner.bounds import compute_bounds
from lazytrain.planner.evaluate import build_plan, decisions_from_tiers, evaluate
from lazytrain.planner.extract import extract_plan, start_from_plan
from lazytrain.planner.heuristics import heuristic_plan
from lazytrain.planner.milp import build_milp
from lazytrain.planner.milp_solve import solve_milp
from lazytrain.planner.path_choice import choose_weight_paths
from lazytrain.planner.plan import SolveRecord
from lazytrain.planner.solvers import solve
from lazytrain.planner.weight_paths import candidate_paths, with_weight_paths
from test_milp import U, small_problem
from test_milp_prices_plans import ROOMY, _decision_columns

MANUAL = SolveRecord(backend="manual")
R, H, D, N = "recompute", "hbm", "dram", "nvme"


def _path_problem(L: int, gpu: bool, h2d: float, host: float = 8e3, **kw):
    """Slow enough H2D that a gpu_cast load (2x bytes) costs, a host conversion rate that
    makes host_convert cost, masters twice the compute dtype."""
    return small_problem(L=L, copies_overlap_compute=gpu, h2d_bytes_per_s=h2d * U,
                         host_convert_bytes_per_s=host * U, master_bytes_ratio=2.0, **kw)


@pytest.mark.parametrize("gpu", [True, False], ids=["overlap", "serial"])
@pytest.mark.parametrize("seed", range(4))
def test_free_path_milp_prices_random_mixed_path_plans_as_the_evaluator(seed, gpu):
    pytest.importorskip("highspy")
    rng = random.Random(seed)
    problem = _path_problem(6, gpu, rng.choice((2e3, 1e4, 5e4)), allow_q8=True,
                            host_bytes_per_param_q8=10.0, q8_penalty_ms_per_gparam=50.0,
                            **ROOMY)
    milp = build_milp(problem, tie_breakers=False, q8_penalty=False, free_paths=True)
    priced = tried = 0
    while priced < 5:
        tried += 1
        assert tried < 200, "fixture: too few random plans the model can express"
        tiers = tuple(rng.choice((R, H, D, N)) for _ in range(6)) + (H,)
        keep = tuple(j for j in range(6) if tiers[j + 1] != R and rng.random() < 0.5)
        q8 = tuple(j for j in range(6) if rng.random() < 0.3)
        paths = tuple(rng.choice(("host_convert", "gpu_cast") if j in q8 else WEIGHT_PATH_NAMES)
                      for j in range(6))
        try:
            decisions = decisions_from_tiers(problem, tiers, keep, q8_blocks=q8)
        except ValueError:
            continue
        plan = build_plan(problem, dataclasses.replace(decisions, weight_paths=paths),
                          solver=MANUAL)
        assert (plan.weight_paths or ("host_convert",) * 6) == paths
        expected = evaluate(problem, plan).step_ms
        x = start_from_plan(milp, plan)
        if x is not None:
            assert milp.step_ms(x) == pytest.approx(expected, rel=1e-9)
        fixed = _decision_columns(milp, plan)
        fixed.update({c: float(paths[j] == w) for (j, w), c in milp.v.path.items()})
        res = solve(milp.model, backend="highs", fixed=fixed, gap=1e-9, time_limit_s=60)
        if res.status == "infeasible":
            assert x is None
            continue
        assert res.status == "optimal", res.status
        chosen = extract_plan(milp, res.values, solver=MANUAL)
        assert (chosen.weight_paths or ("host_convert",) * 6) == paths
        assert milp.step_ms(res.values) == pytest.approx(evaluate(problem, chosen).step_ms,
                                                         rel=1e-7)
        priced += 1


@pytest.mark.parametrize("case", [
    dict(gpu=True, h2d=2e3), dict(gpu=True, h2d=2e4), dict(gpu=False, h2d=1e4),
    dict(gpu=True, h2d=2e3, tight_dram=True), dict(gpu=True, h2d=2e4, tight_hbm=True),
    dict(gpu=True, h2d=5e4, tight_dram=True, host=1e3, roomy_hbm=True)],
    ids=["slow_h2d", "fast_h2d", "serial", "dram_for_one_copy", "hbm_tight",
         "slow_host_dram_for_one_copy"])
def test_free_path_milp_matches_the_best_of_every_path_vector_on_3_blocks(case):
    pytest.importorskip("highspy")
    extra = {}
    base = _path_problem(3, case["gpu"], case["h2d"], case.get("host", 8e3))
    if case.get("tight_dram"):  # room for one pinned copy (P is 40..60 u) beside 300 u
        extra["dram_bytes"] = base.dram_bytes - 300 * U + 70 * U
    if case.get("tight_hbm"):  # the landing slots of a gpu_cast block take most of the room
        extra["hbm_bytes"] = base.hbm_bytes - 400 * U + 330 * U
    if case.get("roomy_hbm"):  # room for the landing slots beside every checkpoint
        extra["hbm_bytes"] = base.hbm_bytes + 1000 * U
    problem = _path_problem(3, case["gpu"], case["h2d"], case.get("host", 8e3), **extra)
    best = _best_by_path_vector(problem)
    assert best, "fixture: no path vector fits"
    milp = build_milp(problem, tie_breakers=False, q8_penalty=False, free_paths=True)
    res = solve(milp.model, backend="highs", gap=1e-9, time_limit_s=60)
    assert res.status == "optimal"
    assert milp.step_ms(res.values) == pytest.approx(min(best.values()), rel=1e-7)
    chosen = extract_plan(milp, res.values, solver=MANUAL)
    assert not chosen.provenance.get("violations")
    assert evaluate(problem, chosen).step_ms == pytest.approx(min(best.values()), rel=1e-7)


def _best_by_path_vector(problem) -> dict:
    """{path vector: the fixed-path model's optimal step, ms} over every per-block vector."""
    best = {}
    for paths in itertools.product(WEIGHT_PATH_NAMES, repeat=problem.num_blocks):
        milp = build_milp(with_weight_paths(problem, paths), tie_breakers=False,
                          q8_penalty=False)
        res = solve(milp.model, backend="highs", gap=1e-9, time_limit_s=60)
        if res.status == "optimal":
            best[paths] = milp.step_ms(res.values)
    return best


def test_solve_milp_chooses_a_per_block_mix_no_candidate_vector_reaches():
    """Fast H2D, DRAM for every copy: the best vector mixes pinned copies and host conversion,
    which no whole-model candidate is; the planner's problem (weight_path_choice) is solved
    with free paths from the heuristic's candidate."""
    pytest.importorskip("highspy")
    problem = _path_problem(3, True, 2e4, weight_path_choice=True)
    best = _best_by_path_vector(problem.replace(weight_path_choice=False))
    top = min(best, key=best.get)
    candidates = candidate_paths(problem)
    assert top not in candidates
    assert best[top] < min(best[c] for c in candidates if c in best) - 1.0
    chosen = choose_weight_paths(problem)
    plan = solve_milp(chosen, backend="highs", gap=1e-9, warm_start=heuristic_plan(chosen))
    assert plan.weight_paths == top
    assert plan.predicted.step_ms == pytest.approx(best[top], rel=1e-6)


def test_bounds_of_the_planners_problem_bound_every_path_vector():
    """Slow host conversion: the heuristic's candidate converts every block on the host, the
    MILP's plan converts none; the memory and roofline bounds of the planner's problem must not
    charge block 0's conversion or any landing slot it may drop."""
    pytest.importorskip("highspy")
    problem = with_weight_paths(_path_problem(3, True, 5e4, 1e3, weight_path_choice=True),
                                ("host_convert",) * 3)
    plan = solve_milp(problem, backend="highs", gap=1e-9, warm_start=heuristic_plan(problem))
    assert "host_convert" not in plan.weight_paths
    bounds = compute_bounds(problem)
    for value in (bounds.lp_step_ms, bounds.memory_step_ms, bounds.roofline_step_ms):
        assert value <= plan.predicted.step_ms * (1 + 1e-9)


def test_feasibility_phase_finds_the_paths_that_fit():
    """Every block gpu_cast leaves no room beside the landing slots; the feasibility phase of
    the planner's problem chooses paths too, so the solve finds a plan that fits."""
    pytest.importorskip("highspy")
    problem = with_weight_paths(_path_problem(3, True, 2e4, weight_path_choice=True),
                                ("gpu_cast",) * 3)
    assert heuristic_plan(problem).provenance.get("violations")
    plan = solve_milp(problem, backend="highs", gap=1e-9)
    assert not plan.provenance.get("violations")
    assert "gpu_cast" not in plan.weight_paths
