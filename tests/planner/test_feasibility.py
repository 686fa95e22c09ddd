"""The feasibility phase: no false "infeasible" on slow links, the least shortfall reported
truthfully (need next to budget, every short budget named), hints only for unused options."""

from __future__ import annotations

import itertools

import pytest

from lazytrain.planner.evaluate import build_plan, decisions_from_tiers, evaluate
from lazytrain.planner.infeasible import shortfall_fix
from lazytrain.planner.heuristics import heuristic_plan, megatrain_plan
from lazytrain.planner.infeasible import PlanInfeasibleError
from lazytrain.planner.milp_solve import solve_milp
from lazytrain.planner.plan import SolveRecord
from lazytrain.planner.problem import PlanningProblem

pytest.importorskip("highspy")

U = 10**7
"""Byte unit: 1 u = 1e7 bytes."""


def small(L: int = 4, **kw) -> PlanningProblem:
    """4 blocks, F 10 ms, A 100u, P 50u; HBM room 300u beside 1000u fixed; links 1e4 u/s."""
    base = dict(
        fwd_ms=(10.0,) * L, fwd_grad_ms=(12.0,) * L, bwd_ms=(20.0,) * L,
        weight_bytes=(50 * U,) * L, grad_bytes=(50 * U,) * L, internal_bytes=(40 * U,) * L,
        boundary_bytes=tuple((100 + 10 * i) * U for i in range(L + 1)),
        params_per_block=(10**8,) * L, head_ms=4.0,
        h2d_bytes_per_s=1e4 * U, d2h_bytes_per_s=1e4 * U, duplex_bytes_per_s=1.5e4 * U,
        nvme_read_bytes_per_s=5e3 * U, nvme_write_bytes_per_s=5e3 * U,
        hbm_bytes=1300 * U, fixed_hbm_bytes=1000 * U, dram_bytes=10**13, nvme_bytes=0,
        host_bytes_per_param=12.0, drain_windows=2, prefetch_windows=2, nvme_lead_windows=1)
    base.update(kw)
    return PlanningProblem(**base)


def _fits(plan) -> bool:
    return not plan.provenance.get("violations")


@pytest.mark.parametrize("h2d_gb_per_s", [0.001, 0.01, 0.02, 1.0])
def test_slow_links_give_no_infeasible_verdict_another_policy_contradicts(h2d_gb_per_s):
    p = small(h2d_bytes_per_s=h2d_gb_per_s * 1e9, d2h_bytes_per_s=h2d_gb_per_s * 1e9,
              duplex_bytes_per_s=1.5 * h2d_gb_per_s * 1e9)
    others = [heuristic_plan(p)] + [megatrain_plan(p, k) for k in range(1, 5)]
    assert any(_fits(o) for o in others)  # the trigger: other policies find a plan that fits
    plan = solve_milp(p, backend="highs", time_limit_s=30)
    assert _fits(plan)
    assert plan.predicted.step_ms <= min(o.predicted.step_ms for o in others if _fits(o)) * (
        1 + 1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("h2d_gb_per_s", [0.001, 0.02])
def test_seed_with_a_slow_link_plans_with_the_milp(repo_root, shared_dir, h2d_gb_per_s):
    from lazytrain.config import load_config
    from lazytrain.planner.build import problem_from_config

    p = problem_from_config(load_config(repo_root / "configs/qwen3.6-27b-h800.yaml",
                                        [f"hardware.h2d_gb_per_s={h2d_gb_per_s}"]))
    plan = solve_milp(p, backend="highs", time_limit_s=20, warm_start=heuristic_plan(p))
    assert _fits(plan)


def test_an_infeasible_verdict_is_never_contradicted_by_the_other_policies():
    p = small(hbm_bytes=1150 * U)  # 150u room: boundary 4 (140u) fits, hardly anything else
    try:
        plan = solve_milp(p, backend="highs", time_limit_s=30)
    except PlanInfeasibleError:
        assert not _fits(heuristic_plan(p))
        assert not any(_fits(megatrain_plan(p, k)) for k in range(1, 5))
    else:
        assert _fits(plan)


def _least_scheduled_hbm_short(p: PlanningProblem) -> float:
    """Brute force over every tier assignment (scheduled transfers): the least HBM shortfall."""
    best = float("inf")
    for head in itertools.product(("hbm", "dram", "recompute"), repeat=p.num_blocks):
        d = decisions_from_tiers(p, head + ("hbm",))
        best = min(best, evaluate(p, d).hbm_short_bytes)
    return best


def test_reported_hbm_shortfall_is_reached_by_a_plan_and_is_the_least():
    p = small(hbm_bytes=1050 * U)  # 50u room; boundary 4 alone needs 140u at the turn
    with pytest.raises(PlanInfeasibleError) as info:
        solve_milp(p, backend="highs", time_limit_s=30)
    err = info.value
    assert err.proven and err.budget == "HBM"
    (short,) = err.shortfalls
    # the need is printed next to the budget, and need - budget is the shortfall
    assert short.budget_bytes == p.hbm_bytes
    assert short.need_bytes - short.budget_bytes == pytest.approx(short.short_bytes)
    assert f"budget {p.hbm_bytes / 1e9:.2f} GB" in str(err)
    # reached by the plan it names (not a sum of per-window slacks) ...
    assert evaluate(p, err.plan).hbm_short_bytes == pytest.approx(err.shortfall_bytes)
    # ... and no scheduled tier assignment does better
    assert err.shortfall_bytes <= _least_scheduled_hbm_short(p) * (1 + 1e-9)
    # every window over budget by more would have been summed before: at least two are over
    assert sum(1 for b in evaluate(p, err.plan).hbm_by_window if b > p.hbm_bytes) >= 2


def test_every_short_budget_is_named_with_its_need():
    states = 12 * 4 * 10**8  # 12 B/param x 4e8 params = 48 GB of optimizer states
    p = small(hbm_bytes=1050 * U, dram_bytes=states - 100 * U)
    with pytest.raises(PlanInfeasibleError) as info:
        solve_milp(p, backend="highs", time_limit_s=30)
    err = info.value
    assert [s.budget for s in err.shortfalls] == ["HBM", "DRAM"]
    dram = err.shortfalls[1]
    assert dram.need_bytes - p.dram_bytes == pytest.approx(dram.short_bytes)
    assert dram.short_bytes >= 100 * U * (1 - 1e-9)
    assert str(err).count("short by") == 2 and "HBM and DRAM budgets" in str(err)


def test_dram_hints_offer_only_what_the_problem_does_not_use():
    fp32_no_nvme = small(host_bytes_per_param=16.0, nvme_bytes=0,
                         provenance={"master_dtype": "fp32"})
    hint = shortfall_fix("DRAM", fp32_no_nvme)
    assert "master_dtype: bf16" in hint and "nvme_gb" in hint and "allow_q8" in hint
    bf16_with_nvme_q8 = small(nvme_bytes=10**12, allow_q8=True,
                              provenance={"master_dtype": "bf16"})
    hint = shortfall_fix("DRAM", bf16_with_nvme_q8)
    assert hint == "raise hardware.dram_gb"


def test_lp_bound_is_none_when_no_fractional_plan_fits():
    from lazytrain.planner.bounds import lp_bound_ms

    assert lp_bound_ms(small(hbm_bytes=900 * U)) is None  # fixed 1000u alone overflows
    p = small()
    plan = build_plan(p, decisions_from_tiers(p, ("dram",) * 4 + ("hbm",)),
                      solver=SolveRecord(backend="manual"))
    assert _fits(plan) and lp_bound_ms(p) <= plan.predicted.step_ms * (1 + 1e-9)
