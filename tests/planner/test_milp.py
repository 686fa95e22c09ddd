"""The placement MILP against the fluid evaluator, the heuristics and its own error contract."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lazytrain.planner.evaluate import build_plan, decisions_from_tiers, evaluate
from lazytrain.planner.heuristics import heuristic_plan, megatrain_plan
from lazytrain.planner.extract import extract_plan, start_from_plan
from lazytrain.planner.gaps import solve_record
from lazytrain.planner.infeasible import PlanInfeasibleError
from lazytrain.planner.milp import build_milp
from lazytrain.planner.milp_solve import solve_milp
from lazytrain.planner.plan import SolveRecord
from lazytrain.planner.problem import PlanningProblem
from lazytrain.units import GB

U = 10**7
"""Byte unit: 1 u = 1e7 bytes; at 1e4 u/s, 100 u moves in 10 ms."""
MANUAL = SolveRecord(backend="manual")


def small_problem(L: int = 6, **kw) -> PlanningProblem:
    """L heterogeneous blocks (F 8..14 ms, A 80..120 u, P 40..60 u); HBM room 400 u beside
    1000 u fixed; DRAM room 300 u; NVMe 200 u; horizons H_d = H_p = 2, H_n = 1; grad_accum 2."""
    F = tuple(8.0 + (3 * j) % 7 for j in range(L))
    base = dict(
        fwd_ms=F, fwd_grad_ms=tuple(f + 2 for f in F), bwd_ms=tuple(2 * f for f in F),
        weight_bytes=tuple((40 + (7 * j) % 21) * U for j in range(L)),
        grad_bytes=(50 * U,) * L, internal_bytes=tuple((30 + 20 * (j % 3)) * U for j in range(L)),
        boundary_bytes=tuple((80 + (13 * i) % 41) * U for i in range(L + 1)),
        params_per_block=(10**8,) * L, ends_params=10**7, embed_ms=1.0, head_ms=4.0,
        const_ms=3.0, h2d_bytes_per_s=1e4 * U, d2h_bytes_per_s=1e4 * U,
        duplex_bytes_per_s=1.5e4 * U, nvme_read_bytes_per_s=5e3 * U,
        nvme_write_bytes_per_s=5e3 * U, hbm_bytes=1400 * U, fixed_hbm_bytes=1000 * U,
        dram_bytes=(12 * (10**8 * L + 10**7) // U + 10 + 300) * U, nvme_bytes=200 * U,
        nvme_staging_bytes=10 * U, host_bytes_per_param=12.0, drain_windows=2,
        prefetch_windows=2, nvme_lead_windows=1, grad_accum=2,
    )
    base.update(kw)
    return PlanningProblem(**base)


TIER_CASES = {
    "all_hbm": ("hbm",) * 7,
    "megatrain_k2": ("hbm", "recompute", "hbm", "recompute", "hbm", "recompute", "hbm"),
    "offload_mix": ("recompute", "dram", "nvme", "recompute", "dram", "hbm", "hbm"),
    "nvme_and_long_segment": ("nvme", "recompute", "recompute", "dram", "recompute", "hbm",
                              "hbm"),
}


@pytest.mark.parametrize("gpu", [True, False], ids=["gpu", "cpu"])
@pytest.mark.parametrize("case", list(TIER_CASES))
def test_model_step_time_of_a_scheduled_plan_equals_the_evaluator(case, gpu):
    """The model's window rows, filled with a plan's decisions, give the evaluator's step
    (budgets large enough for every case: the step-time model's budgets are hard)."""
    problem = small_problem(copies_overlap_compute=gpu, hbm_bytes=10**13, dram_bytes=10**13,
                            nvme_bytes=10**13)
    keep = (5,) if TIER_CASES[case][6] == "hbm" else ()
    d = decisions_from_tiers(problem, TIER_CASES[case], keep_internals=keep)
    plan = build_plan(problem, d, solver=MANUAL)
    milp = build_milp(problem)
    x = start_from_plan(milp, plan)
    assert x is not None, "the plan is not expressible in the model"
    assert milp.step_ms(x) == pytest.approx(evaluate(problem, plan).step_ms, rel=1e-9)


def test_feasibility_model_hbm_slack_of_an_all_hbm_plan_equals_the_evaluator_shortfall():
    """The shared HBM slack is the peak's overflow (not a sum over windows)."""
    problem = small_problem(hbm_bytes=1250 * U)
    plan = build_plan(problem, decisions_from_tiers(problem, ("hbm",) * 7), solver=MANUAL)
    ev = evaluate(problem, plan)
    assert sum(1 for b in ev.hbm_by_window if b > problem.hbm_bytes) > 1  # several windows over
    milp = build_milp(problem, capacity="min_shortfall")
    x = start_from_plan(milp, plan)
    (slack,) = set(milp.v.slack_hbm.values())
    assert x[slack] * GB == pytest.approx(ev.hbm_short_bytes, rel=1e-9)
    assert milp.model.objective_value(x) * GB == pytest.approx(ev.hbm_short_bytes, rel=1e-9)
    assert build_milp(problem) and start_from_plan(build_milp(problem), plan) is None  # hard


@pytest.mark.parametrize("backend", ["highs", "scip"])
def test_milp_objective_equals_the_evaluated_step_of_its_plan(backend):
    pytest.importorskip("pyscipopt" if backend == "scip" else "highspy")
    from lazytrain.planner.solvers import solve

    problem = small_problem()
    milp = build_milp(problem)
    res = solve(milp.model, backend=backend, gap=1e-6, time_limit_s=30)
    plan = extract_plan(milp, res.values, solver=solve_record(milp, res))
    assert milp.step_ms(res.values) == pytest.approx(plan.predicted.step_ms, rel=1e-6)
    assert evaluate(problem, plan).feasible


@pytest.mark.parametrize("gpu", [True, False], ids=["overlap", "serial"])
def test_lp_bound_le_milp_le_heuristic_le_megatrain_on_the_same_evaluator(gpu):
    pytest.importorskip("highspy")
    from lazytrain.planner.bounds import lp_bound_ms

    problem = small_problem(L=8, copies_overlap_compute=gpu, hbm_bytes=1500 * U)
    mega = megatrain_plan(problem, k=4)
    assert evaluate(problem, mega).feasible, "fixture: the MegaTrain rule must fit"
    heur = heuristic_plan(problem)
    milp = solve_milp(problem, backend="highs", gap=1e-6, time_limit_s=30, warm_start=heur)
    steps = [evaluate(problem, p).step_ms for p in (milp, heur, mega)]
    lp = lp_bound_ms(problem)
    assert lp <= steps[0] * (1 + 1e-9)
    assert steps[0] <= steps[1] * (1 + 1e-9) and steps[1] <= steps[2] * (1 + 1e-9), steps


@pytest.mark.parametrize("backend", ["highs", "scip"])
def test_impossible_hbm_budget_names_hbm_the_window_and_the_gb_short(backend):
    pytest.importorskip("pyscipopt" if backend == "scip" else "highspy")
    problem = small_problem(hbm_bytes=1050 * U)  # 50 u room; boundary L alone needs 120 u
    with pytest.raises(PlanInfeasibleError) as info:
        solve_milp(problem, backend=backend, time_limit_s=30)
    err = info.value
    assert re.fullmatch(r"HBM short by \d+\.\d\d GB at window (f\d+|turn|b\d+) \(needs \d+\.\d\d "
                        r"GB, budget \d+\.\d\d GB\):.*", str(err))
    assert err.budget == "HBM" and err.window is not None
    assert err.shortfall_bytes >= (problem.boundary_bytes[-1] - 50 * U) * (1 - 1e-6)


def test_dram_short_of_the_optimizer_states_names_dram_and_the_exact_gb():
    pytest.importorskip("highspy")
    states = 16 * (6 * 10**8 + 10**7)  # fp32 master: 16 B/param
    problem = small_problem(host_bytes_per_param=16.0, dram_bytes=states - 200 * U)
    with pytest.raises(PlanInfeasibleError, match=r"^DRAM short by 2\.10 GB") as info:
        solve_milp(problem, time_limit_s=30)
    # short = states + staging (10 u) - budget = 210 u = 2.1 GB; no checkpoint in DRAM
    assert info.value.shortfall_bytes == pytest.approx(210 * U, rel=1e-6)


def test_eight_bit_states_are_chosen_only_when_dram_needs_them():
    pytest.importorskip("highspy")
    states = 16 * (6 * 10**8 + 10**7)
    # 8-bit moments save 6 B/param = 60 u per block; 30 u short -> one block suffices; at
    # 1000 ms per 1e9 params (100 ms per block) a second block costs more than DRAM
    # checkpoints can save
    problem = small_problem(host_bytes_per_param=16.0, host_bytes_per_param_q8=10.0,
                            allow_q8=True, dram_bytes=states + 10 * U - 30 * U,
                            q8_penalty_ms_per_gparam=1000.0)
    plan = solve_milp(problem, gap=1e-6, time_limit_s=30)
    assert len(plan.q8_blocks) == 1 and evaluate(problem, plan).feasible
    roomy = solve_milp(problem.replace(dram_bytes=states + 10**12), gap=1e-6, time_limit_s=30)
    assert roomy.q8_blocks == ()


@pytest.mark.parametrize("backend", ["highs", "scip"])
def test_time_out_returns_a_plan_no_worse_than_the_warm_start(backend):
    pytest.importorskip("pyscipopt" if backend == "scip" else "highspy")
    problem = small_problem(L=8)
    warm = heuristic_plan(problem)
    assert evaluate(problem, warm).feasible
    plan = solve_milp(problem, backend=backend, time_limit_s=1e-3, warm_start=warm)
    plan.validate()
    assert plan.solver.status in ("time_limit", "no_incumbent", "optimal")
    assert evaluate(problem, plan).step_ms <= evaluate(problem, warm).step_ms * (1 + 1e-9)


def test_same_input_gives_the_same_plan():
    pytest.importorskip("highspy")
    problem = small_problem()
    a, b = (solve_milp(problem, time_limit_s=30).to_dict() for _ in range(2))
    for d in (a, b):
        d["solver"].pop("solve_s")
    assert a == b


def test_rows_and_variables_have_unique_family_names_and_scaled_coefficients():
    """Names are family[idx]; a 27B-like problem keeps matrix coefficients in 1e-3..1e4."""
    L = 8
    problem = small_problem(
        L=L, weight_bytes=(int(0.8e9),) * L, grad_bytes=(int(0.8e9),) * L,
        boundary_bytes=(int(0.755e9),) * (L + 1), internal_bytes=(int(6e9),) * L,
        fwd_ms=(110.0,) * L, fwd_grad_ms=(115.0,) * L, bwd_ms=(220.0,) * L,
        h2d_bytes_per_s=12e9, d2h_bytes_per_s=12e9, duplex_bytes_per_s=20e9,
        nvme_read_bytes_per_s=2.83e9, nvme_write_bytes_per_s=3.35e9,
        hbm_bytes=int(80e9), fixed_hbm_bytes=int(60e9), dram_bytes=int(400e9),
        nvme_bytes=int(14e12))
    m = build_milp(problem).model
    for names in (m.var_names, m.row_names):
        assert len(set(names)) == len(names)
        assert all(re.fullmatch(r"[a-z0-9_]+\[[a-z0-9_,]+\]", n) for n in names)
    coefs = [abs(a) for row in m.row_coeffs for a in row.values()]
    assert 1e-3 <= min(coefs) and max(coefs) <= 1e4, (min(coefs), max(coefs))


def test_planner_imports_load_neither_torch_nor_a_solver():
    code = ("import sys, json; import lazytrain.planner, lazytrain.planner.plan, "
            "lazytrain.planner.milp, lazytrain.planner.solvers, lazytrain.planner.bounds, "
            "lazytrain.planner.policy; print(json.dumps(sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('torch', 'pyscipopt', 'highspy'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert json.loads(out.stdout) == []


def test_gap_is_against_the_best_bound_known_including_the_lp_bound():
    from lazytrain.planner.gaps import gap_against_best_bound

    # a solver stopped before its first dual bound: none, or a trivial one (0 or tiny)
    assert gap_against_best_bound(100.3, None, 100.0) == pytest.approx(0.003)
    assert gap_against_best_bound(100.3, 1e-3, 100.0) == pytest.approx(0.003)
    assert gap_against_best_bound(100.3, 0.0, 100.0) == pytest.approx(0.003)
    # a dual bound above the LP bound is the better one
    assert gap_against_best_bound(100.3, 100.2, 100.0) == pytest.approx(0.1 / 100.2)
    assert gap_against_best_bound(100.3, None, None) is None
    # a bound above the plan is a modelling error: shown as a negative gap, never clamped
    assert gap_against_best_bound(99.0, None, 100.0) == pytest.approx(-0.01)


def test_solve_record_of_a_result_without_dual_bound_uses_the_lp_bound():
    from lazytrain.planner.solvers import SolveResult

    milp = build_milp(small_problem())
    res = SolveResult(backend="scip", status="time_limit", values=None, objective=503.0,
                      dual_bound=None, solve_s=0.1)
    assert res.gap is None  # what the record showed as unknown / 100%
    rec = solve_record(milp, res, lp_bound_ms=500.0)
    assert rec.gap == pytest.approx(0.006)


def test_highs_prints_no_banner_on_stdout_or_stderr(tmp_path):
    pytest.importorskip("highspy")
    # a fresh process: HiGHS prints its banner once per process, on its first instance
    code = ("from lazytrain.planner.milp import build_milp\n"
            "from lazytrain.planner.solvers import solve\n"
            "import sys; sys.path.insert(0, %r)\n"
            "from test_milp import small_problem\n"
            "res = solve(build_milp(small_problem()).model, backend='highs', time_limit_s=30)\n"
            "print('status', res.status)\n" % str(Path(__file__).parent))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "status optimal"
    assert "HiGHS" not in out.stdout + out.stderr


def test_scip_stopped_before_its_first_dual_bound_reports_the_gap_against_the_lp_bound():
    pytest.importorskip("pyscipopt")
    pytest.importorskip("highspy")
    from lazytrain.planner.bounds import lp_bound_ms
    from lazytrain.planner.extract import start_from_plan
    from lazytrain.planner.solvers import solve

    problem = small_problem(L=8, nvme_bytes=10**13)
    milp = build_milp(problem)
    start = start_from_plan(milp, heuristic_plan(problem))
    # a node limit of 0: deterministic stand-in for a time limit shorter than the root LP
    res = solve(milp.model, backend="scip", node_limit=0, start=start, time_limit_s=30)
    assert res.status == "node_limit" and res.values is not None
    assert res.dual_bound is None  # SCIP's -1e20 "infinity" is no bound
    lp = lp_bound_ms(problem)
    rec = solve_record(milp, res, lp_bound_ms=lp)
    assert rec.gap == pytest.approx(res.objective / lp - 1, rel=1e-9)
    assert rec.gap < 0.5  # not the 100% a -1e20 bound gave
