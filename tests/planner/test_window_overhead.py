"""The engine's fixed per-window cost (`window_overhead_ms`, o) in the evaluator, the MILP and the
event simulator: a 2-block problem predicts step = (2L+3) o + the step without it, with every
window time computed by hand."""

from __future__ import annotations

import pytest

from lazytrain.planner.evaluate import Decisions, evaluate
from lazytrain.planner.window_time import post_ms, pre_ms
from lazytrain.planner.plan import Plan
from lazytrain.planner.problem import PlanningProblem
from lazytrain.sim import simulate
from milp_steps import all_hbm_and_optimum

U = 10**7  # byte unit: 1 u = 1e7 bytes
O_MS = 3.0  # the window overhead of these tests, ms


def _problem(**kw) -> PlanningProblem:
    """2 blocks, no host rates. F = 10, Fg = 12, B = 20 ms; P = 200 u, G = 100 u; H2D and D2H
    1e4 u/s (P: 20 ms, G: 10 ms); embed 1 ms, head 4 ms; no keep, no const, grad_accum 1."""
    base = dict(
        fwd_ms=(10.0, 10.0), fwd_grad_ms=(12.0, 12.0), bwd_ms=(20.0, 20.0),
        weight_bytes=(200 * U,) * 2, grad_bytes=(100 * U,) * 2, internal_bytes=(30 * U,) * 2,
        boundary_bytes=(50 * U,) * 3, params_per_block=(10**8,) * 2,
        embed_ms=1.0, head_ms=4.0,
        h2d_bytes_per_s=1e4 * U, d2h_bytes_per_s=1e4 * U, duplex_bytes_per_s=2e4 * U,
        nvme_read_bytes_per_s=5e3 * U, nvme_write_bytes_per_s=5e3 * U,
        hbm_bytes=10**13, fixed_hbm_bytes=0, dram_bytes=10**13, nvme_bytes=0,
        allow_keep=False,
    )
    base.update(kw)
    return PlanningProblem(**base)


ALL_HBM = ("hbm", "hbm", "hbm")
# Without the overhead (window by window, all-HBM):
#   f0: F0 10, loads P1 (20 ms);  f1: F1 10;  turn: head 4, reloads P1 (20 ms);
#   b1: Fg1 + B1 = 32, loads P0 (20 ms);  b0: Fg0 + B0 = 32, drains G1 (10 ms)
#   GPU (max): 20, 10, 20, 32, 32 = 114; pre max(embed 1, P0 20) = 20; post G0 10: step 144
#   CPU (sum): 30, 10, 24, 52, 42 = 158; pre 1 + 20 = 21; post 10: step 189
# With o = 3 ms every window gains 3 ms after its max / sum, pre and post included:
#   GPU: 23, 13, 23, 35, 35; pre 23; post 13: step 144 + 7 x 3 = 165
#   CPU: 33, 13, 27, 55, 45; pre 24; post 13: step 189 + 7 x 3 = 210
GPU_TIMES, GPU_PRE, GPU_POST, GPU_STEP = [23, 13, 23, 35, 35], 23.0, 13.0, 165.0
CPU_TIMES, CPU_PRE, CPU_POST, CPU_STEP = [33, 13, 27, 55, 45], 24.0, 13.0, 210.0
CASES = {"gpu": (True, GPU_TIMES, GPU_PRE, GPU_POST, GPU_STEP),
         "cpu": (False, CPU_TIMES, CPU_PRE, CPU_POST, CPU_STEP)}


@pytest.mark.parametrize("case", list(CASES))
def test_evaluator_adds_the_overhead_to_every_one_of_the_2l_plus_3_windows(case):
    gpu, times, pre, post, step = CASES[case]
    p = _problem(window_overhead_ms=O_MS, copies_overlap_compute=gpu)
    ev = evaluate(p, Decisions(tiers=ALL_HBM))
    assert [w.time_ms for w in ev.windows] == pytest.approx(times)
    assert pre_ms(p) == pytest.approx(pre) and post_ms(p) == pytest.approx(post)
    assert ev.step_ms == pytest.approx(step)
    assert ev.step_ms - evaluate(_problem(copies_overlap_compute=gpu),
                                 Decisions(tiers=ALL_HBM)).step_ms == pytest.approx(7 * O_MS)


@pytest.mark.parametrize("case", list(CASES))
def test_the_event_simulator_adds_the_same_overhead(case):
    gpu, _times, _pre, _post, step = CASES[case]
    p = _problem(window_overhead_ms=O_MS, copies_overlap_compute=gpu)
    r = simulate(p, Plan(tiers=ALL_HBM))
    assert r.step_ms == pytest.approx(step)
    # each window opens with its overhead on the compute stream, the rest waits for it
    b1 = [e for e in r.events if e.window == "b1"]
    first = min(b1, key=lambda e: e.start_ms)
    assert first.kind == "overhead" and first.end_ms - first.start_ms == pytest.approx(O_MS)
    assert all(e.start_ms >= first.end_ms - 1e-9 for e in b1 if e is not first)


@pytest.mark.parametrize("case", list(CASES))
def test_milp_objective_carries_the_overhead_of_every_window(case):
    pytest.importorskip("highspy")
    from lazytrain.planner.milp import build_milp
    from lazytrain.planner.solvers import solve

    gpu, _times, _pre, _post, step = CASES[case]
    milp, start, best = all_hbm_and_optimum(
        _problem(window_overhead_ms=O_MS, copies_overlap_compute=gpu), ALL_HBM)
    assert start == pytest.approx(step)
    base = build_milp(_problem(copies_overlap_compute=gpu), tie_breakers=False)
    res0 = solve(base.model, backend="highs", gap=1e-9, time_limit_s=30)
    # a constant per window: the optimum moves by exactly 7 o, the plan does not change
    assert milp.step_ms(best) - base.step_ms(res0.values) == pytest.approx(7 * O_MS,
                                                                                rel=1e-6)


def test_negative_window_overhead_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="window_overhead_ms must be >= 0"):
        _problem(window_overhead_ms=-1.0)
