"""The host as a resource: weight conversion and gradient accumulation in the window time of the
evaluator and the MILP, checked against windows computed by hand (docs/execution_model.md,
"Host work"); problems without host rates evaluate exactly as before."""

from __future__ import annotations

import pytest

from lazytrain.planner.evaluate import Decisions, evaluate
from lazytrain.planner.window_time import post_ms, pre_ms
from lazytrain.planner.problem import PlanningProblem

U = 10**7  # byte unit: 1 u = 1e7 bytes


def _problem(**kw) -> PlanningProblem:
    """2 blocks, every boundary in HBM. F = 10, Fg = 12, B = 20 ms; P = 200 u, G = 100 u;
    H2D and D2H 1e4 u/s (P: 20 ms, G: 10 ms); host conversion 2e3 u/s (P: 100 ms), host
    accumulation 1e3 u/s (G: 100 ms); embed 1 ms, head 4 ms; no keep, no const, grad_accum 1."""
    base = dict(
        fwd_ms=(10.0, 10.0), fwd_grad_ms=(12.0, 12.0), bwd_ms=(20.0, 20.0),
        weight_bytes=(200 * U,) * 2, grad_bytes=(100 * U,) * 2, internal_bytes=(30 * U,) * 2,
        boundary_bytes=(50 * U,) * 3, params_per_block=(10**8,) * 2,
        embed_ms=1.0, head_ms=4.0,
        h2d_bytes_per_s=1e4 * U, d2h_bytes_per_s=1e4 * U, duplex_bytes_per_s=2e4 * U,
        nvme_read_bytes_per_s=5e3 * U, nvme_write_bytes_per_s=5e3 * U,
        host_convert_bytes_per_s=2e3 * U, host_accumulate_bytes_per_s=1e3 * U,
        hbm_bytes=10**13, fixed_hbm_bytes=0, dram_bytes=10**13, nvme_bytes=0,
        allow_keep=False,
    )
    base.update(kw)
    return PlanningProblem(**base)


ALL_HBM = Decisions(tiers=("hbm", "hbm", "hbm"))

# Per window (compute ms; weights loaded u; gradient drained u; host ms = P/2e3 + G/1e3 u/s):
#   f0:   F0 = 10;        loads P1 200 (H2D 20 ms);  host 200/2e3 s = 100 ms
#   f1:   F1 = 10;        nothing to load (block 2 does not exist);  host 0
#   turn: head 4;         loads P1 again for its backward (20 ms);   host 100 ms
#   b1:   B1 + Fg1 = 32;  loads P0 (20 ms); G2 does not exist;        host 100 ms
#   b0:   B0 + Fg0 = 32;  drains G1 100 (D2H 10 ms);                  host 100/1e3 s = 100 ms
HOST = [100, 0, 100, 100, 100]
COMPUTE = [10, 10, 4, 32, 32]
# GPU: t = max(compute, channels, host) = 100, 10, 100, 100, 100 (sum 410), host-bound in every
# window with host work; pre = max(embed 1, P0 H2D 20, P0 conversion 100) = 100;
# post = max(G0 drain 10, G0 accumulation 100) = 100; step = 100 + 410 + 100 = 610.
GPU_TIMES = [100, 10, 100, 100, 100]
GPU_STEP = 610.0
# CPU: t = compute + channels + host: f0 10+20+100 = 130, f1 10, turn 4+20+100 = 124,
# b1 32+20+100 = 152, b0 32+10+100 = 142 (sum 558); pre = 1+20+100 = 121, post = 10+100 = 110;
# step = 121 + 558 + 110 = 789.
CPU_TIMES = [130, 10, 124, 152, 142]
CPU_STEP = 789.0
# Without host rates (0: not modelled), GPU: 20, 10, 20, 32, 32 (sum 114), pre 20, post 10:
# step 144; CPU: 30, 10, 24, 52, 42 (sum 158), pre 21, post 10: step 189.
NO_HOST_GPU_TIMES, NO_HOST_GPU_STEP = [20, 10, 20, 32, 32], 144.0
NO_HOST_CPU_TIMES, NO_HOST_CPU_STEP = [30, 10, 24, 52, 42], 189.0


def test_evaluator_predicts_host_bound_windows_by_hand():
    ev = evaluate(_problem(), ALL_HBM)
    assert [w.compute_ms for w in ev.windows] == pytest.approx(COMPUTE)
    assert list(ev.host_ms_by_window) == pytest.approx(HOST)
    assert [w.time_ms for w in ev.windows] == pytest.approx(GPU_TIMES)
    assert ev.binding_by_window == ("host", "compute", "host", "host", "host")
    assert pre_ms(_problem()) == pytest.approx(100.0)
    assert post_ms(_problem()) == pytest.approx(100.0)
    assert ev.step_ms == pytest.approx(GPU_STEP)


def test_on_a_cpu_the_host_work_adds_to_the_window_like_the_copies():
    ev = evaluate(_problem(copies_overlap_compute=False), ALL_HBM)
    assert [w.time_ms for w in ev.windows] == pytest.approx(CPU_TIMES)
    assert ev.step_ms == pytest.approx(CPU_STEP)


@pytest.mark.parametrize("gpu", [True, False], ids=["gpu", "cpu"])
def test_problems_without_host_rates_evaluate_exactly_as_before(gpu):
    p = _problem(host_convert_bytes_per_s=0.0, host_accumulate_bytes_per_s=0.0,
                 copies_overlap_compute=gpu)
    ev = evaluate(p, ALL_HBM)
    times, step = ((NO_HOST_GPU_TIMES, NO_HOST_GPU_STEP) if gpu
                   else (NO_HOST_CPU_TIMES, NO_HOST_CPU_STEP))
    assert [w.time_ms for w in ev.windows] == times  # exact: the host adds nothing at all
    assert ev.step_ms == step
    assert ev.host_ms_by_window == (0.0,) * 5


def test_recompute_reloads_are_converted_too():
    # boundary 1 recomputed: segment (0, 2) ends at b1, which re-runs F0 and re-loads P0 on top
    # of its own P0 load for b0: 400 u of weights, 400/2e3 s = 200 ms of conversion, against
    # compute B1 + Fg1 + F0 = 42 ms and H2D 40 ms (the recompute order: P0 20 + P0 20 + F0 10
    # + Fg1 12 + B1 20 = 82 ms): host-bound at 200 ms.
    ev = evaluate(_problem(), Decisions(tiers=("hbm", "recompute", "hbm")))
    b1 = [w for w in ev.windows if w.name == "b1"][0]
    assert ev.host_ms_by_window[3] == pytest.approx(200.0)
    assert b1.time_ms == pytest.approx(200.0)
    assert ev.binding_by_window[3] == "host"


def test_negative_host_rate_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="host_convert_bytes_per_s must be >= 0"):
        _problem(host_convert_bytes_per_s=-1.0)


@pytest.mark.parametrize("gpu", [True, False], ids=["gpu", "cpu"])
def test_milp_predicts_the_same_host_bound_step(gpu):
    pytest.importorskip("highspy")
    from lazytrain.planner.extract import extract_plan
    from lazytrain.planner.gaps import solve_record
    from lazytrain.planner.milp import build_milp
    from lazytrain.planner.solvers import solve

    problem = _problem(copies_overlap_compute=gpu)
    milp = build_milp(problem)
    assert any(name.startswith("time_host[") for name in milp.model.row_names) == gpu
    res = solve(milp.model, backend="highs", gap=1e-9, time_limit_s=30)
    # every plan of this problem is host-bound wherever it loads or drains, and all-HBM (or
    # re-embedding boundary 0, which adds 1 ms of compute under the 100 ms of host work) is
    # the best: recomputing boundary 1 adds 100 ms of conversion in b1
    plan = extract_plan(milp, res.values, solver=solve_record(milp, res))
    if gpu:
        assert milp.step_ms(res.values) == pytest.approx(GPU_STEP, rel=1e-6)
        assert [w.time_ms for w in plan.windows] == pytest.approx(GPU_TIMES)
    else:
        # on a CPU re-embedding costs its 1 ms, so the optimum keeps boundary 0 in HBM
        assert milp.step_ms(res.values) == pytest.approx(CPU_STEP, rel=1e-6)
        assert plan.tiers == ("hbm", "hbm", "hbm")
    assert milp.step_ms(res.values) == pytest.approx(plan.predicted.step_ms, rel=1e-6)


def test_milp_host_row_binds_a_fixed_all_hbm_plan():
    """With the tiers fixed to all-HBM, the MILP's time rows alone give t = 100 in f0: the row
    `time_host[f0]` (t >= P1 / host_conv = 200 u / 2e3 u/s = 100 ms) is the binding one."""
    pytest.importorskip("highspy")
    from lazytrain.planner.extract import start_from_plan
    from lazytrain.planner.milp import build_milp
    from lazytrain.planner.evaluate import build_plan
    from lazytrain.planner.plan import SolveRecord

    problem = _problem()
    milp = build_milp(problem, tie_breakers=False)
    plan = build_plan(problem, ALL_HBM, solver=SolveRecord(backend="manual"))
    x = start_from_plan(milp, plan)
    assert milp.step_ms(x) == pytest.approx(GPU_STEP)
    assert [x[milp.v.t[o]] for o in range(5)] == pytest.approx(GPU_TIMES)
