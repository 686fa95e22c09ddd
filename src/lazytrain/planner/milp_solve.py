"""Solving the placement MILP: `solve_milp(problem) -> Plan`, up to three phases.

1. feasibility (`planner/feasibility.py`): when the warm start is missing or overflows a budget,
   a plan that fits, or `PlanInfeasibleError` naming every short budget;
2. step time: `milp.build_milp` with hard budgets, warm-started from that plan
   (`extract.start_from_plan`), its incumbent read back by `extract.extract_plan`; when the
   planner chooses the weight paths (`PlanningProblem.weight_path_choice`), the model chooses
   each block's (`free_paths`), the warm start's paths its start;
3. least wear (`planner/wear.py`), with `least_wear_slack`, on the step-time plan's paths.

The formulation is `planner/milp.py`'s, the gap of each plan `planner/gaps.py`'s; solver
packages load only inside `planner/solvers.py`. Knows no torch.
"""

from __future__ import annotations

import dataclasses
import math

from lazytrain.planner.extract import extract_plan, start_from_plan
from lazytrain.planner.feasibility import feasible_plan
from lazytrain.planner.gaps import (
    best_claimed_bound_ms, dual_step_bound_ms, gap_against_best_bound, solve_record,
)
from lazytrain.planner.milp import build_milp
from lazytrain.planner.plan import Bounds, Plan
from lazytrain.planner.problem import PlanningProblem
from lazytrain.planner.solvers import resolve_backend, solve, solver_installed
from lazytrain.planner.wear import WEAR_TIME_SHARE, least_wear_plan
from lazytrain.planner.weight_paths import with_weight_paths


def solve_milp(problem: PlanningProblem, *, backend: str = "auto", time_limit_s: float = 10.0,
               gap: float = 0.005, threads: int = 1, seed: int = 0,
               node_limit: int | None = None, warm_start: Plan | None = None,
               bounds: Bounds | None = None, least_wear_slack: float | None = None) -> Plan:
    """Solve the placement MILP and return its plan (the incumbent on a time-out).

    Up to three phases: when `warm_start` is missing or breaks a budget, the feasibility phase
    (`feasibility.feasible_plan`) first finds a plan that fits, or raises naming every short
    budget with its least shortfall; then the step-time model with hard budgets starts from it;
    then, with `least_wear_slack`, the least-wear phase (`wear.least_wear_plan`) looks among the
    plans within that slack of the faster of the step-time plan and the warm start for the one
    writing the least to NVMe, then moving the least over the host link.

    Args:
        problem: the planning problem.
        backend: "auto" (HiGHS up to 64 blocks, SCIP above; see solvers.resolve_backend),
            "highs" or "scip".
        time_limit_s: solver wall-clock limit of each phase, s (model building not counted);
            math.inf: none.
        node_limit: branch-and-bound node limit of each phase (None: none); with no time
            limit the plan does not depend on the machine's load (`planner.deterministic`).
        gap: relative gap at which the search stops.
        threads, seed: solver threads and random seed (defaults: deterministic).
        warm_start: a plan to start from (usually `heuristics.heuristic_plan`); when it fits the
            budgets it is also the answer if the solver finds no incumbent in time.
        bounds: filled into the plan's `bounds` as given; its largest bound also bounds the gap
            (`gap_against_best_bound`).
        least_wear_slack: relative step slack of the least-wear phase, >= 0 (config
            `planner.least_wear_slack`); None: no such phase, the fastest plan found is returned.
            The phase gets `wear.WEAR_TIME_SHARE` of `time_limit_s` and of `node_limit`.

    Returns:
        Plan whose `solver` record holds backend, status ("optimal", "time_limit", or
        "no_incumbent" when the warm start is returned; "...; incumbent over budget, warm start
        kept" when the solver's plan passes a budget by less than its row tolerance, which the
        evaluator counts to the byte), solve_s (every phase after the
        feasibility phase), gap (the plan's step, or the solver's objective, vs. the best bound
        known: the step-time solve's dual bound or the LP bound), num_vars, num_rows. A
        least-wear plan records its phase in provenance `least_wear`.

    Raises:
        PlanInfeasibleError: no plan fits (every short budget named; `proven` is False when the
            feasibility phase timed out).
        ValueError: unknown backend.
    """
    backend = resolve_backend(backend, problem.num_blocks)
    if warm_start is None or warm_start.provenance.get("violations"):
        warm_start = feasible_plan(problem, backend=feasibility_backend(backend),
                                   time_limit_s=time_limit_s, threads=threads, seed=seed,
                                   start=warm_start, node_limit=node_limit)
    milp = build_milp(problem, free_paths=problem.weight_path_choice)
    start = start_from_plan(milp, warm_start)
    res = solve(milp.model, backend=backend, time_limit_s=time_limit_s, gap=gap,
                threads=threads, seed=seed, start=start, node_limit=node_limit)
    lp = best_claimed_bound_ms(bounds)
    record = solve_record(milp, res, lp_bound_ms=lp)
    if res.values is None:
        if res.status == "infeasible":
            raise RuntimeError(f"{backend} reports the placement model infeasible although the "
                               f"feasibility phase found a plan: a model bug (rows "
                               f"{milp.model.num_rows})")
        return dataclasses.replace(warm_start, solver=dataclasses.replace(
            record, status="no_incumbent", gap=gap_against_best_bound(
                warm_start.predicted.step_ms, dual_step_bound_ms(milp, res.dual_bound), lp)),
            bounds=bounds or warm_start.bounds)
    solved = extract_plan(milp, res.values, solver=record, bounds=bounds)
    solved = dataclasses.replace(solved, solver=solve_record(
        milp, res, lp_bound_ms=lp, step_ms=solved.predicted.step_ms))
    if solved.provenance.get("violations"):
        # within the solver's row tolerance (HiGHS: 1e-6 of a row in GB, about 1 kB) but over a
        # budget by the evaluator's exact bytes; the warm start fits (feasibility phase)
        solved = dataclasses.replace(warm_start, solver=dataclasses.replace(
            record, status=f"{res.status}; incumbent over budget, warm start kept",
            gap=gap_against_best_bound(warm_start.predicted.step_ms,
                                       dual_step_bound_ms(milp, res.dual_bound), lp)),
            bounds=bounds or warm_start.bounds)
    if least_wear_slack is None:
        return solved
    reference = solved
    if (not warm_start.provenance.get("violations") and warm_start.predicted is not None
            and warm_start.predicted.step_ms < solved.predicted.step_ms):
        reference = warm_start
    wear = least_wear_plan(
        with_weight_paths(milp.problem, reference.weight_paths), reference,
        slack=least_wear_slack, backend=backend,
        time_limit_s=time_limit_s * WEAR_TIME_SHARE, threads=threads, seed=seed,
        node_limit=None if node_limit is None else math.ceil(node_limit * WEAR_TIME_SHARE),
        dual_bound_ms=dual_step_bound_ms(milp, res.dual_bound), lp_bound_ms=lp, bounds=bounds)
    if wear is None:
        return solved
    return dataclasses.replace(wear, solver=dataclasses.replace(
        wear.solver, status=record.status, solve_s=record.solve_s + wear.solver.solve_s,
        num_vars=record.num_vars, num_rows=record.num_rows))


def feasibility_backend(backend: str) -> str:
    """The solver of the feasibility phase: HiGHS when installed, else `backend`. Measured on
    the NVMe-heavy 128-block benchmark (benchmarks/planner.py): HiGHS proves a fitting plan
    in 0.9 s where SCIP needs 27 s, and SCIP ran out of a 30 s limit on 2 busy cores."""
    return "highs" if solver_installed("highs") else backend
