"""One entry point from a planning problem to a Plan: `plan_with_policy` (CLI and train use it).

Dispatches on the planner policy (milp | heuristic | megatrain | ideal), fills the plan's
`bounds` (LP relaxation, roofline, ideal) and, for milp, warm-starts the solver from the
heuristic and ships the better of {solver incumbent, heuristic} by predicted step time.

Importing this module loads no solver; `milp`/`solvers` are imported only when a policy needs
them. Knows no torch.
"""

from __future__ import annotations

import dataclasses

from lazytrain.planner.plan import Bounds, Plan
from lazytrain.planner.problem import PlanningProblem

POLICIES = ("milp", "heuristic", "megatrain", "ideal")
"""Planner policies (config `planner.policy`)."""


def plan_with_policy(problem: PlanningProblem, policy: str = "milp", *, backend: str = "auto",
                     time_limit_s: float = 10.0, gap: float = 0.005, threads: int = 1,
                     seed: int = 0, megatrain_k: int = 4, lp_bound: bool = True) -> Plan:
    """Plan with one policy and attach the bounds.

    Args:
        problem: the planning problem.
        policy: "milp" (solver, warm-started by the heuristic), "heuristic", "megatrain"
            (every megatrain_k-th boundary in HBM, the rest recomputed), or "ideal"
            (infinite HBM; a reference, usually over budget).
        backend: "auto", "highs" or "scip" (milp only; the LP bound always uses HiGHS when installed).
        time_limit_s: solver limit, s; the heuristic gets a tenth of it.
        gap: relative MILP gap at which the solver stops.
        threads, seed: solver threads and seed (deterministic by default).
        megatrain_k: K of the MegaTrain rule.
        lp_bound: compute the LP-relaxation bound (needs a solver package).

    Returns:
        Plan with `bounds` filled.

    Raises:
        ValueError: unknown policy or backend.
        PlanInfeasibleError: (milp) no plan fits the HBM, DRAM or NVMe budget.
    """
    from lazytrain.planner import heuristics

    if policy not in POLICIES:
        raise ValueError(f"planner.policy must be one of {POLICIES}; got {policy!r}")
    bounds = _bounds(problem, lp=lp_bound)
    if policy == "megatrain":
        plan = heuristics.megatrain_plan(problem, k=megatrain_k)
    elif policy == "ideal":
        plan = heuristics.ideal_plan(problem)
    else:
        plan = heuristics.heuristic_plan(problem, time_budget_s=max(0.5, time_limit_s / 10))
        if policy == "milp":
            from lazytrain.planner.milp import gap_against_best_bound, solve_milp

            solved = solve_milp(problem, backend=backend, time_limit_s=time_limit_s, gap=gap,
                                threads=threads, seed=seed, warm_start=plan, bounds=bounds)
            if plan.predicted is None or solved.predicted.step_ms <= plan.predicted.step_ms \
                    or "violations" in plan.provenance:
                plan = solved
            else:  # the heuristic's step against the same best bound the solver's gap used
                g = solved.solver.gap
                best = (solved.predicted.step_ms / (1 + g)) if g is not None else None
                plan = dataclasses.replace(plan, solver=dataclasses.replace(
                    solved.solver, status=f"{solved.solver.status}; heuristic kept",
                    gap=gap_against_best_bound(plan.predicted.step_ms, best,
                                               bounds.lp_step_ms)))
    return dataclasses.replace(plan, bounds=bounds)


def _bounds(problem: PlanningProblem, *, lp: bool) -> Bounds:
    """The plan's reference step times; the LP relaxation goes to HiGHS when it is installed
    (an LP solver), else SCIP, whichever backend the MILP itself uses."""
    from lazytrain.planner.bounds import compute_bounds

    lp_backend = "highs"
    try:
        import highspy  # noqa: F401
    except ImportError:
        lp_backend = "scip"
    return compute_bounds(problem, lp=lp, backend=lp_backend)
