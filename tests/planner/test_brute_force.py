"""Both MILP backends find the optimum of an exhaustive enumeration on problems of <= 4 blocks.

The enumeration is independent of the solvers' search: it lists every discrete choice (tier of
each boundary 0..L-1 among hbm/dram/nvme/recompute, where recompute of boundary 0 means
re-embed; keep-internals of each block whose next boundary is materialized), fixes exactly those
binaries in the model, and solves what remains with HiGHS: the continuous NVMe fractions and
window times, plus the window of each whole D2H and H2D (the model moves each in one window so
that HBM holding is exact) and which blocks hold resident weights without keeping internals
(at least the kept ones; a handful of binaries per choice). Capacity slacks are fixed to 0, so
a choice that cannot fit is skipped.
The minimum over all choices is the true optimum of the model; each backend's plan, scored by
the fluid evaluator, must match it.
"""

from __future__ import annotations

import itertools
import math

import pytest

from lazytrain.planner.evaluate import evaluate
from lazytrain.planner.milp import build_milp
from lazytrain.planner.milp_solve import solve_milp
from lazytrain.planner.milp_vars import WHOLE_TRANSFERS
from lazytrain.planner.problem import PlanningProblem

U = 10**7
"""Byte unit of the fixtures: 1 u = 1e7 bytes; at 1e4 u/s, 100 u moves in 10 ms."""


def tiny_problem(L: int = 4, **kw) -> PlanningProblem:
    """Heterogeneous blocks so that optima are unique; HBM room 260 u beside 1000 u fixed;
    DRAM room 200 u beside 12 B/param states (4.1e8 params = 492 u) and 10 u staging."""
    F = (10.0, 14.0, 8.0, 12.0)[:L]
    base = dict(
        fwd_ms=F, fwd_grad_ms=tuple(f + 2 for f in F), bwd_ms=tuple(2 * f for f in F),
        weight_bytes=(50 * U, 60 * U, 40 * U, 55 * U)[:L], grad_bytes=(50 * U,) * L,
        internal_bytes=(150 * U, 120 * U, 60 * U, 30 * U)[:L],
        boundary_bytes=(100 * U, 80 * U, 120 * U, 90 * U, 100 * U)[:L] + (100 * U,),
        params_per_block=(10**8,) * L, ends_params=10**7 + (4 - L) * 10**8,
        embed_ms=1.0, head_ms=4.0, const_ms=3.0,
        h2d_bytes_per_s=1e4 * U, d2h_bytes_per_s=1e4 * U, duplex_bytes_per_s=1.5e4 * U,
        nvme_read_bytes_per_s=5e3 * U, nvme_write_bytes_per_s=5e3 * U,
        hbm_bytes=1260 * U, fixed_hbm_bytes=1000 * U, dram_bytes=702 * U, nvme_bytes=1000 * U,
        nvme_staging_bytes=10 * U, host_bytes_per_param=12.0,
        drain_windows=2, prefetch_windows=2, nvme_lead_windows=1, grad_accum=2,
    )
    base.update(kw)
    return PlanningProblem(**base)


SCENARIOS = {
    # GPU, HBM room 280 u, DRAM for one checkpoint, NVMe for one: offload, recompute, keep and
    # resident weights compete.
    "gpu_tight_hbm": tiny_problem(hbm_bytes=1280 * U, dram_bytes=602 * U, nvme_bytes=100 * U),
    # CPU: copies contend with compute (window = compute + channel times).
    "cpu_contention": tiny_problem(copies_overlap_compute=False, hbm_bytes=1350 * U),
    # DRAM room 215 u: two checkpoints, or one beside the bounce buffer of one NVMe boundary in
    # flight (horizons of one window keep those short); a fast NVMe and forwards 4x as long,
    # so a third offload beats recompute and goes through NVMe.
    "nvme_favouring": tiny_problem(dram_bytes=717 * U, nvme_read_bytes_per_s=2e4 * U,
                                   nvme_write_bytes_per_s=2e4 * U, hbm_bytes=1250 * U,
                                   drain_windows=1, prefetch_windows=1, nvme_lead_windows=1,
                                   fwd_ms=(40.0, 56.0, 32.0, 48.0),
                                   fwd_grad_ms=(42.0, 58.0, 34.0, 50.0),
                                   bwd_ms=(80.0, 112.0, 64.0, 96.0)),
    # A slow H2D link (a weight load 5-6x a forward), HBM room for the weights but not the
    # internals: blocks hold resident weights without keeping internals.
    "slow_h2d_resident": tiny_problem(L=3, h2d_bytes_per_s=1e3 * U, hbm_bytes=1350 * U,
                                      nvme_bytes=0),
}


def brute_force_optimum(problem: PlanningProblem) -> tuple[float, tuple]:
    """min over every discrete choice of the remaining program over transfers (HiGHS), and its
    argmin."""
    highspy = pytest.importorskip("highspy")
    import numpy as np

    milp = build_milp(problem, relax=True, tie_breakers=False)
    m, v, L = milp.model, milp.v, problem.num_blocks
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("threads", 1)
    h.setOptionValue("mip_rel_gap", 0.0)  # each choice's optimum exactly, not within 1e-4
    highspy.Highs.resetGlobalScheduler(True)
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = m.num_vars, m.num_rows
    lp.col_cost_ = np.array(m.obj)
    lp.col_lower_, lp.col_upper_ = np.array(m.var_lb), np.array(m.var_ub)
    lp.row_lower_, lp.row_upper_ = np.array(m.row_lb), np.array(m.row_ub)
    lp.offset_ = m.obj_offset
    starts = np.cumsum([0] + [len(r) for r in m.row_coeffs])
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_ = starts
    lp.a_matrix_.index_ = np.array([c for r in m.row_coeffs for c in r], dtype=np.int32)
    lp.a_matrix_.value_ = np.array([a for r in m.row_coeffs for a in r.values()])
    whole = {c for fam in WHOLE_TRANSFERS for c in v.transfer(fam).values()}
    whole |= set(v.resident.values())
    lp.integrality_ = [highspy.HighsVarType.kInteger if c in whole
                       else highspy.HighsVarType.kContinuous for c in range(m.num_vars)]
    h.passModel(lp)
    fixed_cols = (list(v.seg.values()) + list(v.mat.values()) + list(v.hbm.values())
                  + list(v.dram.values()) + list(v.nvme.values()) + list(v.emb.values())
                  + list(v.keep.values()) + list(v.q8.values()) + list(v.slack_hbm.values())
                  + list(v.slack_host.values()))
    tiers_of = ("hbm", "dram", "nvme", "recompute") if problem.nvme_bytes else (
        "hbm", "dram", "recompute")
    best, arg = math.inf, None
    for tiers in itertools.product(tiers_of, repeat=L):
        tiers = tiers + ("hbm",)
        starts_ = [0] + [i for i in range(1, L + 1) if tiers[i] != "recompute"]
        segs = list(zip(starts_[:-1], starts_[1:]))
        if any(e - s > problem.k_max for s, e in segs):
            continue
        keepable = [j for j in range(L) if tiers[j + 1] != "recompute"] \
            if problem.allow_keep else []
        for nkeep in range(len(keepable) + 1):
            for keep in itertools.combinations(keepable, nkeep):
                value = dict.fromkeys(fixed_cols, 0.0)
                for s, e in segs:
                    value[v.seg[s, e]] = 1.0
                for i in range(1, L):
                    value[v.mat[i]] = float(tiers[i] != "recompute")
                for i in range(L):
                    if tiers[i] != "recompute":
                        value[getattr(v, tiers[i])[i]] = 1.0
                if tiers[0] == "recompute":
                    value[v.emb[segs[0][1]]] = 1.0
                for j in keep:
                    value[v.keep[j]] = 1.0
                cols = np.array(list(value), dtype=np.int32)
                vals = np.array(list(value.values()))
                h.changeColsBounds(len(cols), cols, vals, vals)
                h.run()
                if h.getModelStatus() == highspy.HighsModelStatus.kOptimal:
                    obj = h.getInfo().objective_function_value
                    if obj < best - 1e-9:
                        x = h.getSolution().col_value
                        resident = tuple(j for j, c in v.resident.items() if x[c] > 0.5)
                        best, arg = obj, (tiers, keep, resident)
    return best, arg


@pytest.mark.parametrize("backend", ["highs", "scip"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_milp_matches_brute_force_on_tiny_problems(scenario, backend):
    pytest.importorskip("pyscipopt" if backend == "scip" else "highspy")
    problem = SCENARIOS[scenario]
    best, arg = brute_force_optimum(problem)
    assert math.isfinite(best), "every discrete choice was infeasible; the fixture is wrong"
    plan = solve_milp(problem, backend=backend, gap=0.0, time_limit_s=30)
    step = evaluate(problem, plan).step_ms
    assert step == pytest.approx(best, rel=1e-6), (plan.tiers, plan.keep_internals,
                                                   plan.resident_weights, arg)


def test_scenarios_exercise_offload_recompute_keep_and_nvme():
    """The fixtures are not degenerate: their optima use the choices they are meant to test."""
    pytest.importorskip("highspy")
    used = {name: brute_force_optimum(p)[1] for name, p in SCENARIOS.items()}
    gpu_tiers, gpu_keep, _ = used["gpu_tight_hbm"]
    assert {"dram", "recompute"} <= set(gpu_tiers) and gpu_keep, used
    assert "recompute" in used["cpu_contention"][0], used
    assert "nvme" in used["nvme_favouring"][0], used
    _, keep, resident = used["slow_h2d_resident"]
    assert set(resident) - set(keep), used
