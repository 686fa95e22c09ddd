"""Bounds: roofline and ideal against hand arithmetic; LP <= MILP; policies carry the bounds."""

from __future__ import annotations

import pytest

from lazytrain.planner.bounds import compute_bounds, ideal_ms, lp_bound_ms, roofline_ms
from lazytrain.planner.evaluate import evaluate
from lazytrain.planner.heuristics import ideal_plan
from lazytrain.planner.policy import POLICIES, PlannerOptions, plan as plan_problem
from lazytrain.planner.problem import PlanningProblem

U = 10**7
"""Byte unit: 1 u = 1e7 bytes; at 1e4 u/s, 100 u moves in 10 ms."""


def two_blocks(**kw) -> PlanningProblem:
    """F 10, Fg 12, B 20 ms; P 100 u (10 ms H2D), G 50 u (5 ms D2H), duplex 1.5e4 u/s;
    embed 1, head 4, const 3 ms; grad_accum 2; room for everything in HBM."""
    base = dict(
        fwd_ms=(10.0, 10.0), fwd_grad_ms=(12.0, 12.0), bwd_ms=(20.0, 20.0),
        weight_bytes=(100 * U,) * 2, grad_bytes=(50 * U,) * 2, internal_bytes=(30 * U,) * 2,
        boundary_bytes=(40 * U,) * 3, params_per_block=(10**8,) * 2, embed_ms=1.0,
        head_ms=4.0, const_ms=3.0, h2d_bytes_per_s=1e4 * U, d2h_bytes_per_s=1e4 * U,
        duplex_bytes_per_s=1.5e4 * U, nvme_read_bytes_per_s=5e3 * U,
        nvme_write_bytes_per_s=5e3 * U, hbm_bytes=10**12, dram_bytes=10**12, grad_accum=2,
    )
    base.update(kw)
    return PlanningProblem(**base)


# grad_accum 2: micro-batch 0's pre loads P0 = max(embed 1, P0 10) = 10 ms on a GPU (side by
# side), 1 + 10 = 11 on a CPU; its post drains G0 (50u) and prefetches P0 (100u) for micro-batch
# 1: on a GPU they share the cap 15 u/ms at 7.5 each until G0 ends (6.67 ms), P0's last 50u
# alone at 10 u/ms: 11.67 ms; on a CPU 10 + 5 = 15. Micro-batch 1: pre = embed 1, post = G0 5.
# step = 2 * windows + ends + 3
ENDS_GPU = 10 + (50 / 7.5 + 5) + 1 + 5
ENDS_CPU = 11 + 15 + 1 + 5


@pytest.mark.parametrize("kw,expected", [
    # keep offered: compute Fg 24 + B 40 + head 4 = 68 > H2D P1 10, D2H G1 5, duplex 10
    ({}, 2 * 68 + ENDS_GPU + 3),
    # no keep: compute F 20 + Fg 24 + B 40 + head 4 = 88; H2D P1 + P0 + P1 = 30 ms
    ({"allow_keep": False}, 2 * 88 + ENDS_GPU + 3),
    # CPU: compute 68 + H2D 10 + D2H 5 = 83
    ({"copies_overlap_compute": False}, 2 * 83 + ENDS_CPU + 3),
    # slow H2D (1e3 u/s): P = 100 ms; windows max(68, H2D 100) = 100; pre (load) max(1, 100),
    # post (prefetch) P0 100 ms at its own 1 u/ms beside G0 at 10 (1 + 10 within the cap)
    ({"h2d_bytes_per_s": 1e3 * U}, 2 * 100 + (100 + 100 + 1 + 5) + 3),
], ids=["gpu_keep", "gpu_no_keep", "cpu", "h2d_bound"])
def test_roofline_matches_hand_arithmetic(kw, expected):
    assert roofline_ms(two_blocks(**kw)) == pytest.approx(expected, rel=1e-12)


def test_ideal_plan_step_matches_hand_arithmetic_and_the_heuristics_ideal_plan():
    # all hbm, both blocks kept: f0 max(Fg 12, P1 10) = 12; f1 12; turn 4 (P1 resident);
    # b1 B 20 (no re-forward, P0 resident); b0 max(B 20, G1 5) = 20 -> windows 68
    problem = two_blocks()
    assert ideal_ms(problem) == pytest.approx(2 * 68 + ENDS_GPU + 3, rel=1e-12)
    assert ideal_ms(problem) == pytest.approx(evaluate(problem, ideal_plan(problem)).step_ms)


def _tight(**kw) -> PlanningProblem:
    """Four blocks, HBM room for about two boundaries, DRAM for one: recompute is needed."""
    base = dict(
        fwd_ms=(10.0, 14.0, 8.0, 12.0), fwd_grad_ms=(12.0, 16.0, 10.0, 14.0),
        bwd_ms=(20.0, 28.0, 16.0, 24.0), weight_bytes=(50 * U, 60 * U, 40 * U, 55 * U),
        grad_bytes=(50 * U,) * 4, internal_bytes=(150 * U, 120 * U, 60 * U, 30 * U),
        boundary_bytes=(100 * U, 80 * U, 120 * U, 90 * U, 100 * U),
        params_per_block=(10**8,) * 4, embed_ms=1.0, head_ms=4.0, const_ms=3.0,
        h2d_bytes_per_s=1e4 * U, d2h_bytes_per_s=1e4 * U, duplex_bytes_per_s=1.5e4 * U,
        nvme_read_bytes_per_s=5e3 * U, nvme_write_bytes_per_s=5e3 * U,
        hbm_bytes=1250 * U, fixed_hbm_bytes=1000 * U, dram_bytes=12 * 4 * 10**8 + 100 * U,
        host_bytes_per_param=12.0, nvme_bytes=0, grad_accum=2,
    )
    base.update(kw)
    return PlanningProblem(**base)


@pytest.mark.parametrize("gpu", [True, False], ids=["overlap", "serial"])
def test_roofline_le_lp_bound_le_milp_step(gpu):
    pytest.importorskip("highspy")
    from lazytrain.planner.milp_solve import solve_milp

    problem = _tight(copies_overlap_compute=gpu)
    plan = solve_milp(problem, gap=1e-6, time_limit_s=30)
    lp = lp_bound_ms(problem)
    assert roofline_ms(problem) <= lp * (1 + 1e-9)
    assert lp <= evaluate(problem, plan).step_ms * (1 + 1e-9)


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_returns_a_plan_with_all_three_bounds(policy):
    pytest.importorskip("highspy")
    problem = _tight()
    plan = plan_problem(problem, PlannerOptions(policy=policy, time_limit_s=10, gap=1e-6,
                                                megatrain_k=2))
    b = plan.bounds
    assert b == compute_bounds(problem)
    assert b.roofline_step_ms <= b.lp_step_ms
    if policy == "milp":
        assert b.lp_step_ms <= plan.predicted.step_ms * (1 + 1e-9)
        assert plan.solver.backend == "highs"
    plan.validate()


def test_unknown_policy_is_rejected_naming_the_choices():
    with pytest.raises(ValueError, match="planner.policy must be one of"):
        plan_problem(_tight(), PlannerOptions(policy="greedy"))


def test_memory_bound_matches_hand_arithmetic_with_room_for_one_kept_block():
    # room = hbm - fixed - A[2] = 200 - 0 - 40 = 160 u; keeping a block costs I + P = 130 u, so
    # one block fits whole and 30/130 of the other: compute 88 - F 10 * (1 + 30/130) = 75.69;
    # H2D: P1 + P0 + P1 = 300 u + boundary 1's way back min(A 40, P0 100) = 40 u, less the
    # resident weights and hbm boundary 1 that fit the room (every ratio 1: 160 u) = 180 u =
    # 18 ms; windows 75.69
    problem = two_blocks(hbm_bytes=200 * U)
    comp = 88 - 10 * (1 + 30 / 130)
    from lazytrain.planner.bounds import memory_bound_ms
    assert memory_bound_ms(problem) == pytest.approx(2 * comp + ENDS_GPU + 3, rel=1e-12)
    # unlimited HBM: every block kept -> the roofline
    assert memory_bound_ms(two_blocks()) == pytest.approx(roofline_ms(two_blocks()), rel=1e-12)
    assert memory_bound_ms(two_blocks(hbm_bytes=30 * U)) is None  # A[2] alone overflows


@pytest.mark.parametrize("hbm_u", [1200, 1250, 1400])
def test_memory_bound_lies_between_the_roofline_and_every_plan_that_fits(hbm_u):
    pytest.importorskip("highspy")
    from lazytrain.planner.bounds import memory_bound_ms
    from lazytrain.planner.heuristics import heuristic_plan, megatrain_plan
    from lazytrain.planner.milp_solve import solve_milp

    problem = _tight(hbm_bytes=hbm_u * U, nvme_bytes=10**12)
    bound = memory_bound_ms(problem)
    assert roofline_ms(problem) <= bound * (1 + 1e-12)
    plans = [heuristic_plan(problem), solve_milp(problem, backend="highs", time_limit_s=30)]
    plans += [megatrain_plan(problem, k) for k in range(1, 5)]
    fitting = [p for p in plans if not p.provenance.get("violations")]
    assert fitting
    assert all(bound <= p.predicted.step_ms * (1 + 1e-9) for p in fitting)
