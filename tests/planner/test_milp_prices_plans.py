"""The MILP's own rows price every plan exactly as the evaluator does.

Each plan's decisions (segments, tiers, keep, 8-bit states) are fixed as column bounds; HiGHS
then chooses the rest (transfer windows, window times t[o], slacks), and the objective read
back must equal the evaluator's step of the plan it returns, on the plan kinds the engine's
test matrix runs and on random plans. Where the model can express a plan's own transfer
windows, the rows filled with them (`start_from_plan`, the warm start's completion) must give
the evaluator's step too. A row that drifts from the evaluator (a sign, a missing term) fails.
"""

from __future__ import annotations

import random

import pytest

from lazytrain.planner.evaluate import build_plan, decisions_from_tiers, evaluate
from lazytrain.planner.extract import extract_plan, start_from_plan
from lazytrain.planner.milp import build_milp
from lazytrain.planner.plan import SolveRecord
from test_milp import small_problem

R, H, D, N = "recompute", "hbm", "dram", "nvme"
MANUAL = SolveRecord(backend="manual")

ENGINE_MATRIX = {
    # the plan kinds of the engine's gradient matrix on its first 4 blocks (two more hbm blocks
    # follow: the model offers no window for an NVMe round trip of the last boundary)
    "all_hbm_segments_of_1": ([H, H, H, H, H], ()),
    "all_dram": ([D, D, D, D, H], ()),
    "all_nvme": ([N, N, N, N, H], ()),
    "mixed_tiers": ([R, D, H, N, H], ()),
    "segments_of_2": ([H, R, H, R, H], ()),
    "segments_of_3_and_1": ([D, R, R, H, H], ()),
    "one_segment_of_4_reembedded": ([R, R, R, R, H], ()),
    "keep_internals_last_blocks": ([H, R, H, H, H], (2, 3)),
    "keep_after_recomputed_segment": ([N, R, R, D, H], (2, 3)),
    "keep_every_block": ([H, D, N, H, H], (0, 1, 2, 3)),
    "keep_inside_offloaded_chain": ([D, D, N, D, H], (0, 2)),
}
ROOMY = dict(hbm_bytes=10**13, dram_bytes=10**13, nvme_bytes=10**13)


def _decision_columns(milp, plan) -> dict[int, float]:
    """Segments, tiers, re-embedding, keep and 8-bit columns of `plan` (transfers left free)."""
    v, L = milp.v, milp.p.L
    fixed = {c: 0.0 for fam in (v.seg, v.mat, v.hbm, v.dram, v.nvme, v.emb, v.keep, v.q8)
             for c in fam.values()}
    for s, e in plan.segments():
        fixed[v.seg[s, e]] = 1.0
        if s > 0:
            fixed[v.mat[s]] = 1.0
    for i, tier in enumerate(plan.tiers[:L]):
        if tier != R:
            fixed[getattr(v, tier)[i]] = 1.0
        elif i == 0:
            fixed[v.emb[plan.segment_end_of(0)]] = 1.0
    fixed.update({v.keep[j]: 1.0 for j in plan.keep_internals})
    fixed.update({v.q8[j]: 1.0 for j in plan.q8_blocks})
    return fixed


def _assert_milp_prices_like_the_evaluator(problem, decisions) -> bool:
    """Two prices of the plan by the model's rows, each against the evaluator:
    1. the plan as given, when the model can express its transfer windows (`start_from_plan`
       fills t[o] with the least value its rows allow);
    2. the plan's tiers, keep and 8-bit blocks fixed, the solver choosing the transfer windows:
       its objective must be the evaluator's step of the plan it returns.
    Returns False (nothing priced) when the model offers no windows for the plan's tiers."""
    from lazytrain.planner.solvers import solve

    plan = build_plan(problem, decisions, solver=MANUAL)
    milp = build_milp(problem, tie_breakers=False, q8_penalty=False)
    x = start_from_plan(milp, plan)
    if x is not None:
        assert milp.step_ms(x) == pytest.approx(evaluate(problem, plan).step_ms, rel=1e-9)
    res = solve(milp.model, backend="highs", fixed=_decision_columns(milp, plan), gap=1e-9,
                time_limit_s=60)
    if res.status == "infeasible":  # tiers the model offers no windows for (see ENGINE_MATRIX)
        assert x is None, "the model rejects the tiers of a plan it can express"
        return False
    assert res.status == "optimal", res.status
    chosen = extract_plan(milp, res.values, solver=MANUAL)
    assert (chosen.tiers, chosen.keep_internals, chosen.q8_blocks) == (
        plan.tiers, plan.keep_internals, plan.q8_blocks)
    assert milp.step_ms(res.values) == pytest.approx(evaluate(problem, chosen).step_ms,
                                                     rel=1e-7)
    return True


@pytest.mark.parametrize("h2d", [1e4, 1.5e3], ids=["fast_h2d", "slow_h2d"])
@pytest.mark.parametrize("gpu", [True, False], ids=["overlap", "serial"])
@pytest.mark.parametrize("kind", list(ENGINE_MATRIX))
def test_milp_rows_price_each_engine_plan_kind_as_the_evaluator(kind, gpu, h2d):
    """Slow H2D: a kept block's weights (not reloaded in the next backward window) decide the
    window, so a wrong weight-load term in any b{j} row shows."""
    pytest.importorskip("highspy")
    problem = small_problem(L=6, copies_overlap_compute=gpu, h2d_bytes_per_s=h2d * 10**7,
                            **ROOMY)
    tiers, keep = ENGINE_MATRIX[kind]
    priced = _assert_milp_prices_like_the_evaluator(
        problem, decisions_from_tiers(problem, (*tiers, H, H), keep))
    assert priced


def _random_decisions(problem, rng: random.Random):
    """Random tiers (boundary L hbm), a random kept subset, random 8-bit blocks; None when the
    horizons leave no legal transfer schedule."""
    L = problem.num_blocks
    tiers = tuple(rng.choice((R, H, D, N)) for _ in range(L)) + (H,)
    keep = tuple(j for j in range(L) if tiers[j + 1] != R and rng.random() < 0.5)
    q8 = tuple(j for j in range(L) if rng.random() < 0.3)
    try:
        return decisions_from_tiers(problem, tiers, keep, q8_blocks=q8)
    except ValueError:
        return None


@pytest.mark.parametrize("gpu", [True, False], ids=["overlap", "serial"])
@pytest.mark.parametrize("seed", range(4))
def test_milp_rows_price_random_plans_as_the_evaluator(seed, gpu):
    pytest.importorskip("highspy")
    rng = random.Random(seed)
    problem = small_problem(L=6, copies_overlap_compute=gpu, allow_q8=True,
                            host_bytes_per_param_q8=10.0, q8_penalty_ms_per_gparam=50.0,
                            h2d_bytes_per_s=rng.choice((2e3, 1e4, 5e4)) * 10**7, **ROOMY)
    priced = tried = 0
    while priced < 6:
        tried += 1
        decisions = _random_decisions(problem, rng)
        if decisions is not None:
            priced += _assert_milp_prices_like_the_evaluator(problem, decisions)
        assert tried < 200, "fixture: too few random plans the model can express"
