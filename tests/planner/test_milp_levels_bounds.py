"""Every bound stays a bound when the problem offers save levels.

The reference is the brute-force optimum of `test_milp_levels` (every plan of three blocks,
levels, saved tiers and transfer windows included, priced by the evaluator) and the MILP's
plan: the LP relaxation, the memory bound, the roofline and the ideal plan must lie at or below
both. The closed forms must also let the levels remove the re-forward: on a problem whose
optimum saves internals, dropping the levels may not lower a bound.
"""

from __future__ import annotations

import pytest

from lazytrain.planner.bounds import compute_bounds, ideal_ms, memory_bound_ms, roofline_ms
from lazytrain.planner.milp_solve import solve_milp
from test_milp_levels import SCENARIOS, U, level_problem, optimum


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_every_bound_is_at_or_below_the_optimum_with_levels(scenario):
    pytest.importorskip("highspy")
    problem = SCENARIOS[scenario]
    best, _ = optimum(scenario)
    plan = solve_milp(problem, backend="highs", gap=1e-9, time_limit_s=60)
    b = compute_bounds(problem)
    for name in ("lp_step_ms", "memory_step_ms", "roofline_step_ms", "ideal_step_ms"):
        value = getattr(b, name)
        assert value is not None, name
        assert value <= best * (1 + 1e-9), (name, value, best)
        assert value <= plan.predicted.step_ms * (1 + 1e-9), (name, value)


@pytest.mark.parametrize("allow_keep", [False, True], ids=["levels_only", "levels_and_keep"])
def test_closed_form_bounds_allow_the_levels_to_remove_the_re_forward(allow_keep):
    """Roomy HBM and DRAM: every block may save at L2, so the roofline and the memory bound
    must be at most the step of every block at L2 in HBM (no re-forward anywhere), and no
    higher than without levels."""
    pytest.importorskip("highspy")
    problem = level_problem(allow_keep=allow_keep, hbm_bytes=10**13, dram_bytes=10**13)
    plan = solve_milp(problem, backend="highs", gap=1e-9, time_limit_s=60)
    assert set(plan.save_levels) == {"L2"} or plan.keep_internals
    plain = problem.replace(saved_bytes=(), reforward_l1_ms=())
    for bound in (roofline_ms, memory_bound_ms, ideal_ms):
        assert bound(problem) <= plan.predicted.step_ms * (1 + 1e-9), bound.__name__
        assert bound(problem) <= bound(plain) * (1 + 1e-12), bound.__name__
    if not allow_keep:  # without keep only the levels cut the re-forward: strictly lower
        assert roofline_ms(problem) < roofline_ms(plain)
        assert memory_bound_ms(problem) < memory_bound_ms(plain)
        assert ideal_ms(problem) < ideal_ms(plain)


def test_memory_bound_takes_the_best_level_per_block_within_the_room():
    """One block, Fg = 12, F = 10, its re-forward Fr = 0.8 Fg = 9.6 ms, Fr1 = 0.4 Fg = 4.8 ms:
    L2 (S2 = 130 u) saves F + Fr - Fg = 7.6 ms, L1 (S1 = 30 u) 7.6 - 4.8 = 2.8 ms; L1's 2.8/30
    ms per u beats the step from L1 up to L2 (4.8 / 100), so both lie on the hull. The compute
    term less the most the room allows, by hand: room 15 u saves half of L1's, 1.4; 30 u 2.8;
    80 u 2.8 + 50 x 0.048 = 5.2; 130 u and more 7.6. With S1 = 50 u L1 falls under the line
    to L2 (2.8/50 < 7.6/130): room 50 u saves 50 x 7.6/130, more than L1's 2.8. The bound is
    the compute term there (the links are fast), so differences of bounds are these savings."""

    def bound(room_u: int, s1_u: int = 30) -> float:
        p = level_problem(L=1, hbm_bytes=(1000 + 90 + room_u) * U, saved_bytes=(
            (s1_u * U, 130 * U),), dram_bytes=12 * (10**8 + 10**7) + 10 * U,
            h2d_bytes_per_s=1e6 * U, d2h_bytes_per_s=1e6 * U, duplex_bytes_per_s=1.5e6 * U)
        return memory_bound_ms(p)

    ga = 2  # level_problem's grad_accum: the window part counts per micro-batch
    full = bound(0)
    for room, saved in ((15, 1.4), (30, 2.8), (80, 5.2), (130, 7.6), (500, 7.6)):
        assert full - bound(room) == pytest.approx(ga * saved, rel=1e-9), room
    assert full - bound(50, s1_u=50) == pytest.approx(ga * 50 * 7.6 / 130, rel=1e-9)


def test_lp_bound_gains_nothing_from_internals_no_whole_transfer_can_hide():
    """Internals of 400-500 u (HBM room 400 u beside 1000 u fixed: only the dram tier is
    offered) move in 40-50 ms at 1e4 u/s. Their d2h runs in f1, f2 or the turn (legal windows
    of blocks 0 and 1; block 2 has no pair), whose compute is at most 14 ms, so it adds at
    least 26 ms, while a level saves at most Fr - (Fg - F) = 0.8 x 16 - 2 = 10.8 ms (block 1):
    no plan saves a level, and the LP relaxation with levels must bound as high as without
    them. Without the transfer cuts (family 12b) the relaxation spreads fractions of them over
    the links' idle time and bounds lower (277.9 against 281.5 ms when written)."""
    pytest.importorskip("highspy")
    from lazytrain.planner.bounds import lp_bound_ms

    problem = level_problem(saved_bytes=((400 * U, 500 * U),) * 3, dram_bytes=10**13,
                            hbm_bytes=1400 * U)
    plain = problem.replace(saved_bytes=(), reforward_l1_ms=())
    assert lp_bound_ms(problem) == pytest.approx(lp_bound_ms(plain), rel=1e-9)


@pytest.mark.parametrize("gpu", [True, False], ids=["gpu", "cpu"])
def test_memory_bound_charges_dram_tier_internals_their_copies(gpu):
    """One block, no HBM room beside boundary L (hbm = 1000 u fixed + 90 u), DRAM unlimited:
    saved internals can only wait in DRAM, and w u of them move w more each way. Compute
    43.6 ms (F 10 + Fr 9.6 + B 20 + head 4) less 7.6/130 ms per u (L2's hull; L1 lies under
    it); links at 4e3 u/s each way, duplex 6e3: the reload of P[0] = 50 u plus w H2D, w D2H,
    (50 + 2w)/6 ms on the shared link, which binds past w = 50. GPU: the least max is the
    crossing 43.6 - 7.6 w/130 = (50 + 2w)/6, w = 90.01 u, 38.34 ms, against 43.6 without
    levels (x grad_accum 2). CPU: a u moved costs 0.5 ms of copies for 0.058 ms saved, so
    none moves and the bound is the one without levels."""
    problem = level_problem(L=1, hbm_bytes=1090 * U, dram_bytes=10**13,
                            h2d_bytes_per_s=4e3 * U, d2h_bytes_per_s=4e3 * U,
                            duplex_bytes_per_s=6e3 * U, copies_overlap_compute=gpu)
    plain = problem.replace(saved_bytes=(), reforward_l1_ms=())
    w = (43.6 - 50 / 6) / (2 / 6 + 7.6 / 130)
    saved = 2 * (43.6 - (50 + 2 * w) / 6) if gpu else 0.0
    assert memory_bound_ms(plain) - memory_bound_ms(problem) == pytest.approx(saved, abs=1e-9)
