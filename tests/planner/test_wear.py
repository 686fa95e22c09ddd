"""The least-wear phase (planner/wear.py): among the plans within the step slack of the fastest,
the one that writes the fewest NVMe bytes, then moves the fewest host bytes.

The reference is an enumeration independent of the phase: every discrete choice (the tier of
each boundary among hbm/dram/nvme/recompute and every keep set) with the binaries fixed in the
step-time model and the rest (transfer windows, fractions, window times) solved by HiGHS to
optimality, as in test_brute_force. The fastest step T* is the least of those; the choices
within (1 + slack) T* are eligible; NVMe bytes and host bytes of a choice are written by hand
from its tiers (ga x A[i] per nvme boundary; ga x 2 A[i] per dram or nvme boundary).
"""

from __future__ import annotations

import itertools
import math

import pytest

from lazytrain.config import PlannerConfig, load_config
from lazytrain.contract import align_up
from lazytrain.errors import ConfigError
from lazytrain.planner.evaluate import build_plan, decisions_from_tiers, evaluate
from lazytrain.planner.milp import build_milp
from lazytrain.planner.milp_solve import solve_milp
from lazytrain.planner.policy import PlannerOptions, plan, planner_options
from lazytrain.planner.problem import PlanningProblem
from tests.planner.test_brute_force import SCENARIOS, U, tiny_problem

pytest.importorskip("highspy")

from lazytrain.planner.extract import extract_plan  # noqa: E402
from lazytrain.planner.plan import SolveRecord  # noqa: E402
from lazytrain.planner.solvers import solve  # noqa: E402
from lazytrain.planner.wear import moved_plan, wear_milp  # noqa: E402

REL = 1e-7
"""Relative tolerance on the enumeration's steps (HiGHS solves each choice to 1e-7 or so):
two choices within it tie."""


def nvme_bytes(problem: PlanningProblem, tiers) -> float:
    return problem.grad_accum * sum(problem.boundary_bytes[i] for i, t in enumerate(tiers)
                                    if t == "nvme")


def host_bytes(problem: PlanningProblem, tiers) -> float:
    return problem.grad_accum * sum(2 * problem.boundary_bytes[i] for i, t in enumerate(tiers)
                                    if t in ("dram", "nvme"))


def fixed_choice(milp, tiers, keep) -> dict[int, float]:
    """The decided binaries (segments, tiers, re-embed, keep) of one choice as fixed columns."""
    v, L = milp.v, milp.p.L
    starts = [0] + [i for i in range(1, L + 1) if tiers[i] != "recompute"]
    segs = list(zip(starts[:-1], starts[1:]))
    fixed = dict.fromkeys((c for fam in (v.seg, v.mat, v.hbm, v.dram, v.nvme, v.emb, v.keep)
                           for c in fam.values()), 0.0)
    fixed.update({v.seg[s, e]: 1.0 for s, e in segs})
    fixed.update({v.mat[i]: 1.0 for i in range(1, L) if tiers[i] != "recompute"})
    fixed.update({getattr(v, t)[i]: 1.0 for i, t in enumerate(tiers[:L]) if t != "recompute"})
    if tiers[0] == "recompute":
        fixed[v.emb[segs[0][1]]] = 1.0
    fixed.update({v.keep[j]: 1.0 for j in keep})
    return fixed


def every_choice(problem: PlanningProblem) -> list[tuple[float, tuple[str, ...], tuple]]:
    """(least step in ms, tiers, keep) of every discrete choice that fits the budgets."""
    milp = build_milp(problem, tie_breakers=False, q8_penalty=False)
    L = problem.num_blocks
    out = []
    for tiers in itertools.product(("hbm", "dram", "nvme", "recompute"), repeat=L):
        tiers = tiers + ("hbm",)
        keepable = [j for j in range(L) if tiers[j + 1] != "recompute"]
        for keep in itertools.chain.from_iterable(
                itertools.combinations(keepable, n) for n in range(len(keepable) + 1)):
            res = solve(milp.model, backend="highs", gap=0.0,
                        fixed=fixed_choice(milp, tiers, keep))
            if res.status == "optimal":
                out.append((res.objective, tiers, keep))
    return out


def least_wear_reference(problem: PlanningProblem, slack: float) -> tuple[float, float, float]:
    """(T* in ms, least NVMe bytes, least host bytes among those) within (1 + slack) T*."""
    choices = every_choice(problem)
    best = min(step for step, _, _ in choices)
    eligible = [tiers for step, tiers, _ in choices if step <= best * (1 + slack) * (1 + REL)]
    least = min((nvme_bytes(problem, t), host_bytes(problem, t)) for t in eligible)
    return best, *least


CASES = {
    # the fastest plan writes boundary 1 (80 u) to NVMe each micro-batch; within 1% a plan
    # that writes nothing exists, within 0.1% none does
    "nvme_favouring-1%": ("nvme_favouring", 0.01),
    "nvme_favouring-0.1%": ("nvme_favouring", 0.001),
}


@pytest.mark.parametrize("case", list(CASES))
def test_least_wear_plan_writes_the_enumerated_minimum_within_the_slack(case):
    name, slack = CASES[case]
    problem = SCENARIOS[name]
    best, least_nvme, least_host = least_wear_reference(problem, slack)
    got = solve_milp(problem, backend="highs", gap=0.0, least_wear_slack=slack)
    assert nvme_bytes(problem, got.tiers) == least_nvme, got.tiers
    assert host_bytes(problem, got.tiers) == least_host, got.tiers
    assert got.predicted.step_ms <= best * (1 + slack) * (1 + 1e-6)
    assert got.predicted.step_ms == pytest.approx(evaluate(problem, got).step_ms, rel=1e-12)


FAST_NVME = dict(L=3, nvme_read_bytes_per_s=2e4 * U, nvme_write_bytes_per_s=2e4 * U,
                 nvme_lead_windows=2)
TIES = {
    # boundary 0 in DRAM or on NVMe: every copy hides behind compute, the steps tie (351 ms);
    # DRAM room for one 100 u boundary padded to 4 KiB (an NVMe boundary's bounce buffer)
    "dram_or_nvme": tiny_problem(**FAST_NVME, hbm_bytes=1200 * U,
                                 dram_bytes=502 * U + align_up(100 * U)),
    # more HBM: four plans tie (299 ms), two write nothing; of those the one with boundary 1 in
    # HBM moves 320 u less over the host link
    "then_host_traffic": tiny_problem(**FAST_NVME, hbm_bytes=1300 * U, dram_bytes=702 * U),
}


@pytest.mark.parametrize("name", list(TIES))
def test_exact_ties_go_to_the_plan_that_wears_nothing(name):
    """Plans with and without an NVMe boundary tie on the fastest step. Started from a tied
    plan that writes to NVMe, the step-time solve is done at once (its gap is met), so only
    the least-wear phase (slack 0) moves off it."""
    problem = TIES[name]
    choices = every_choice(problem)
    best = min(step for step, _, _ in choices)
    least = min((nvme_bytes(problem, t), host_bytes(problem, t)) for step, t, _ in choices
                if step <= best * (1 + REL))
    tiers, keep = next((t, k) for step, t, k in choices
                       if step <= best * (1 + REL) and nvme_bytes(problem, t) > 0)
    milp = build_milp(problem, tie_breakers=False, q8_penalty=False)
    res = solve(milp.model, backend="highs", gap=0.0, fixed=fixed_choice(milp, tiers, keep))
    tied = extract_plan(milp, res.values, solver=SolveRecord(backend="manual"))
    assert tied.predicted.step_ms == pytest.approx(best, rel=1e-9)
    got = solve_milp(problem, backend="highs", warm_start=tied, least_wear_slack=0.0)
    assert (nvme_bytes(problem, got.tiers), host_bytes(problem, got.tiers)) == least
    assert got.predicted.step_ms <= best * (1 + 1e-6)


def test_the_least_wear_model_alone_reaches_the_enumerated_minimum():
    """The weighted objective orders plans as (NVMe bytes, host bytes), without the moves."""
    problem, slack = SCENARIOS["nvme_favouring"], 0.01
    best, least_nvme, least_host = least_wear_reference(problem, slack)
    fastest = solve_milp(problem, backend="highs", gap=0.0)
    milp = wear_milp(problem, cap_ms=(1 + slack) * fastest.predicted.step_ms, reference=fastest)
    res = solve(milp.model, backend="highs", gap=0.0)
    got = extract_plan(milp, res.values, solver=SolveRecord(backend="highs"))
    assert (nvme_bytes(problem, got.tiers), host_bytes(problem, got.tiers)) == (least_nvme,
                                                                                least_host)


def test_single_boundary_moves_keep_the_plan_fitting_and_within_the_cap():
    problem, slack = SCENARIOS["nvme_favouring"], 0.01
    fastest = solve_milp(problem, backend="highs", gap=0.0)
    cap = (1 + slack) * fastest.predicted.step_ms
    moved = moved_plan(problem, fastest, cap_ms=cap)
    ev = evaluate(problem, moved)
    assert not ev.violations and ev.step_ms <= cap * (1 + REL)
    assert nvme_bytes(problem, moved.tiers) <= nvme_bytes(problem, fastest.tiers)
    moved.validate()


def test_moves_never_recompute_the_end_of_a_resident_block():
    """HBM has room for the plan (peak 1370 u with block 0's weights resident, 1320 u without)
    but not for DRAM boundary 1 (80 u) beside it, DRAM has room for it alone: with an unbounded
    cap the only move left (less host traffic) is to recompute boundary 1, which a resident
    block 0 forbids (it must end its segment) and which is taken without one."""
    problem = tiny_problem(**FAST_NVME, hbm_bytes=1390 * U, dram_bytes=582 * U)

    def tier_of_boundary_1_after_moves(resident: tuple[int, ...]) -> str:
        start = build_plan(problem, decisions_from_tiers(problem, ("hbm", "dram", "hbm", "hbm"),
                                                         resident_weights=resident),
                           solver=SolveRecord(backend="manual"))
        assert not start.provenance.get("violations")
        return moved_plan(problem, start, cap_ms=math.inf).tiers[1]

    assert tier_of_boundary_1_after_moves((0,)) == "dram"
    assert tier_of_boundary_1_after_moves(()) == "recompute"


def test_the_policy_ships_the_least_wear_plan_and_its_gap_against_a_true_bound():
    """The heuristic start may be faster than the least-wear plan by up to the slack; the policy
    still ships the latter, and its recorded gap is at least its distance to the optimum."""
    problem, slack = SCENARIOS["nvme_favouring"], 0.01
    best, least_nvme, _ = least_wear_reference(problem, slack)
    got = plan(problem, PlannerOptions(backend="highs", gap=0.0, least_wear_slack=slack))
    assert nvme_bytes(problem, got.tiers) == least_nvme
    assert "least_wear" in got.provenance
    assert got.solver.gap >= (got.predicted.step_ms - best) / best - 1e-9


def test_least_wear_is_a_documented_planner_option_with_a_checked_range():
    assert planner_options(PlannerConfig()).least_wear_slack == 0.001
    assert planner_options(PlannerConfig(least_wear=False)).least_wear_slack is None
    with pytest.raises(ConfigError, match=r"planner\.least_wear_slack must be in \[0, 0\.05\]"):
        load_config(overrides=["planner.least_wear_slack=0.5"])
    assert math.isclose(load_config(overrides=["planner.least_wear_slack=0"])
                        .planner.least_wear_slack, 0.0)
