"""The feasibility phase of the MILP: a plan that fits every budget, or the least shortfall.

`feasible_plan` solves `milp.build_milp(capacity="min_shortfall")`: the placement model with
one HBM slack shared by every window (so the slack is the peak's overflow, not a sum over
windows) plus the DRAM and NVMe slacks, minimizing their sum in GB. A zero optimum gives a plan
that fits (the warm start of the step-time model); a positive one is the least total shortfall,
and the error names every budget that plan overflows with its need next to its budget
(`PlanInfeasibleError`, `planner/infeasible.py`, whose hints offer only what the problem does
not already use). Knows no torch; the solver goes through `solvers.solve`.
"""

from __future__ import annotations

from lazytrain.planner.evaluate import build_plan
from lazytrain.planner.extract import extract_decisions, start_from_plan
from lazytrain.planner.infeasible import SLACK_TOL_GB, shortfall_error
from lazytrain.planner.milp import build_milp
from lazytrain.planner.plan import Plan, SolveRecord
from lazytrain.planner.problem import PlanningProblem
from lazytrain.planner.solvers import solve

def feasible_plan(problem: PlanningProblem, *, backend: str, time_limit_s: float,
                  threads: int = 1, seed: int = 0, start: Plan | None = None,
                  node_limit: int | None = None) -> Plan:
    """A plan that fits the HBM, DRAM and NVMe budgets (not optimized for time).

    Args:
        problem: the planning problem.
        backend: "highs" or "scip".
        time_limit_s: solver limit, s (math.inf: none).
        threads, seed: solver threads and seed.
        node_limit: branch-and-bound node limit (None: none).
        start: a plan to start from, even one that overflows (its shortfall is an incumbent).

    When the planner chooses the weight paths (`PlanningProblem.weight_path_choice`) the model
    chooses them too (`milp.build_milp(free_paths=True)`): a plan fits when any path vector does.

    Returns:
        The plan of the feasibility optimum (solver status "feasibility").

    Raises:
        PlanInfeasibleError: the least total shortfall is positive; names every short budget
            (window, need, budget) of the plan that reaches it. `proven` is False when the
            solver stopped before proving that no plan fits.
            Also (not proven) when the solver stopped with no assignment and `start`
            overflows: the shortfall of `start`.
        RuntimeError: the solver stopped with no assignment and no overflowing `start`.
    """
    milp = build_milp(problem, capacity="min_shortfall", free_paths=problem.weight_path_choice)
    x0 = start_from_plan(milp, start) if start is not None else None
    res = solve(milp.model, backend=backend, time_limit_s=time_limit_s, gap=1e-6,
                threads=threads, seed=seed, start=x0, node_limit=node_limit)
    if res.values is None and start is not None and start.provenance.get("violations"):
        # no assignment in time and none from the start (a plan the model cannot express):
        # the start's shortfall, with its fix, says more than the time limit alone
        raise shortfall_error(problem, start, proven=False)
    if res.values is None:
        raise RuntimeError(f"{backend} found no assignment of the feasibility model in "
                           f"{time_limit_s} s (status {res.status}); raise planner.time_limit_s")
    record = SolveRecord(backend=res.backend, status="feasibility", solve_s=res.solve_s,
                         num_vars=milp.model.num_vars, num_rows=milp.model.num_rows)
    plan = build_plan(problem, extract_decisions(milp, res.values), solver=record)
    if res.objective <= SLACK_TOL_GB and not plan.provenance.get("violations"):
        return plan
    proven = res.status == "optimal" or (res.dual_bound is not None
                                         and res.dual_bound > SLACK_TOL_GB)
    raise shortfall_error(problem, plan, proven=proven)
