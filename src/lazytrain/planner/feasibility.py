"""The feasibility phase of the MILP: a plan that fits every budget, or the least shortfall.

`feasible_plan` solves `milp.build_milp(capacity="min_shortfall")`: the placement model with
one HBM slack shared by every window (so the slack is the peak's overflow, not a sum over
windows) plus the DRAM and NVMe slacks, minimizing their sum in GB. A zero optimum gives a plan
that fits (the warm start of the step-time model); a positive one is the least total shortfall,
and the error names every budget that plan overflows with its need next to its budget
(`PlanInfeasibleError`). The hints (`shortfall_fix`) offer only what the problem does not
already use. Knows no torch; the solver goes through `solvers.solve`.
"""

from __future__ import annotations

from lazytrain.contract import HOST_BYTES_PER_PARAM
from lazytrain.planner.milp import (
    SHORTFALL_FIX, SLACK_TOL_GB, PlanInfeasibleError, Shortfall, build_milp,
)
from lazytrain.planner.plan import Plan, SolveRecord
from lazytrain.planner.problem import PlanningProblem

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
    from lazytrain.planner.evaluate import build_plan
    from lazytrain.planner.extract import extract_decisions, start_from_plan
    from lazytrain.planner.solvers import solve

    milp = build_milp(problem, capacity="min_shortfall")
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


def shortfalls_of(problem: PlanningProblem, plan: Plan) -> tuple[Shortfall, ...]:
    """Every budget `plan` overflows (evaluator figures), HBM first, with need and budget."""
    from lazytrain.planner.evaluate import evaluate

    ev = evaluate(problem, plan)
    out = []
    if ev.hbm_short_bytes > 0:
        worst = max(range(len(ev.hbm_by_window)), key=ev.hbm_by_window.__getitem__)
        out.append(Shortfall(budget="HBM", window=ev.windows[worst].name,
                             short_bytes=ev.hbm_short_bytes, need_bytes=ev.peak_hbm_bytes,
                             budget_bytes=problem.hbm_bytes))
    if ev.dram_short_bytes > 0:
        out.append(Shortfall(budget="DRAM", window=None, short_bytes=ev.dram_short_bytes,
                             need_bytes=ev.dram_bytes, budget_bytes=problem.dram_bytes))
    if ev.nvme_short_bytes > 0:
        out.append(Shortfall(budget="NVMe", window=None, short_bytes=ev.nvme_short_bytes,
                             need_bytes=ev.nvme_bytes, budget_bytes=problem.nvme_bytes))
    return tuple(out)


def shortfall_error(problem: PlanningProblem, plan: Plan, *, proven: bool
                    ) -> PlanInfeasibleError:
    """The error for a plan that overflows: every short budget and its conditional fix."""
    short = shortfalls_of(problem, plan)
    if not short:  # the solver's slack and the evaluator disagree by less than a byte
        short = (Shortfall(budget="HBM", window=None, short_bytes=SLACK_TOL_GB * 1e9),)
    return PlanInfeasibleError(shortfalls=short, proven=proven, plan=plan,
                               fixes={s.budget: shortfall_fix(s.budget, problem) for s in short})


def shortfall_fix(budget: str, problem: PlanningProblem) -> str:
    """What to change for `budget` ("HBM" | "DRAM" | "NVMe"), leaving out what `problem` already
    does (bf16 masters, 8-bit states offered, an NVMe budget set)."""
    if budget != "DRAM":
        return SHORTFALL_FIX[budget]
    options = ["raise hardware.dram_gb"]
    master = problem.provenance.get("master_dtype")
    if master == "fp32" or (master is None
                            and problem.host_bytes_per_param > HOST_BYTES_PER_PARAM["bf16"]):
        options.append(f"use train.master_dtype: bf16 ({HOST_BYTES_PER_PARAM['bf16']:g} B/param "
                       f"instead of {HOST_BYTES_PER_PARAM['fp32']:g})")
    if not problem.allow_q8:
        options.append("set planner.allow_q8: true (8-bit Adam states)")
    if problem.nvme_bytes <= 0:
        options.append("give checkpoints an NVMe budget (hardware.nvme_gb)")
    return ", ".join(options[:-1]) + ", or " + options[-1] if len(options) > 1 else options[0]
