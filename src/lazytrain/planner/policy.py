"""The one planning entry: `plan(problem, options, warm_start=None) -> Plan`.

Every caller plans through `plan`: `train/setup.make_plan` (the trainer, each rank of a
data-parallel job), `train/replan.resolve` (online re-planning), `lazytrain plan` (the CLI),
the scaling table (`planner/topology.py`) and the batch search (`planner/capacity.py`). The
solver options come from the config in one function, `planner_options`, whose defaults are the
config's own (`config.PlannerConfig`: backend "auto", 10 s, gap 0.5%, 1 thread, seed 0), so
the same config plans the same way from every caller.

`plan` dispatches on the policy (milp | heuristic | megatrain | ideal), fills the plan's
`bounds` (LP relaxation when asked, memory bound, roofline, ideal) and, for milp, warm-starts
the solver from the best start it has and ships the better of {solver incumbent, start} by
predicted step time (the solver's least-wear plan, `planner/wear.py`, counts as better while
within `least_wear_slack` of the start: it was chosen to write less to NVMe). The start is the
heuristic plan (its save levels chosen greedily, `heuristics.greedy_levels`), or `warm_start`'s
decisions re-evaluated under `problem` (levels given the same way) when those are predicted
faster and fit (a re-plan starts from the running plan); policy heuristic returns that start.
With neither HiGHS nor SCIP installed (`solvers.installed_backends`), policy milp returns that
start too, with provenance `milp_unavailable` (`MILP_UNAVAILABLE`), and no plan
carries an LP bound: the other three bounds are closed forms and evaluator runs, valid for
every plan without a solver.

Importing this module loads no solver package: highspy and pyscipopt load only inside
`planner/solvers.py`'s adapters, when a policy solves. Knows no torch.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from lazytrain.config import PlannerConfig
from lazytrain.planner import heuristics
from lazytrain.planner.bounds import compute_bounds
from lazytrain.planner.budgets import pinned_overrun_bytes, plan_budgets
from lazytrain.planner.evaluate import Decisions, build_plan
from lazytrain.planner.gaps import best_claimed_bound_ms, gap_against_best_bound
from lazytrain.planner.infeasible import PlanInfeasibleError, Shortfall, shortfall_fix
from lazytrain.planner.milp_solve import solve_milp
from lazytrain.planner.path_choice import choose_weight_paths
from lazytrain.planner.plan import Bounds, Plan, SolveRecord
from lazytrain.planner.problem import PlanningProblem
from lazytrain.planner.solvers import SOLVER_PACKAGES, installed_backends

POLICIES = ("milp", "heuristic", "megatrain", "ideal")
"""Planner policies (config `planner.policy`)."""
BACKENDS = ("auto", "highs", "scip")
"""MILP backends (config `planner.backend`)."""
MILP_UNAVAILABLE = (f"MILP unavailable: neither {' nor '.join(SOLVER_PACKAGES.values())} is "
                    f"installed, so the heuristic planned and no LP bound was computed (pip "
                    f"install highspy for the MILP)")
"""Plan provenance `milp_unavailable` of a milp-policy plan made without a solver (the plan
summary and table print it as one line)."""
HEURISTIC_TIME_SHARE = 0.1
"""The heuristic start gets this share of `time_limit_s` (at least HEURISTIC_MIN_S): the MILP
improves on it, so it only needs a good incumbent."""
HEURISTIC_MIN_S = 0.5
"""Least time budget of the heuristic start, s."""
DETERMINISTIC_NODES_PER_S = 50
"""`planner.deterministic`: branch-and-bound nodes per second of `time_limit_s`, the node
limit of each solver phase. HiGHS explored 35 to 135 nodes/s on 12- and 24-block problems on
2 shared cores (2026-12-02), so the default 10 s becomes 500 nodes, about as long."""
HEURISTIC_STEPS_PER_S = 1000
"""`planner.deterministic`: heuristic steps (repair rounds, local-search moves looked at) per
second of its time budget. The seed scenario (64 blocks) took 444 steps in the 0.5 s its 1 s
budget left after the starts (2 shared cores, 2026-12-02)."""

_CONFIG_DEFAULTS = PlannerConfig()


@dataclass(kw_only=True, frozen=True, slots=True)
class PlannerOptions:
    """How `plan` plans; the defaults are `config.PlannerConfig`'s (`planner_options` builds
    one from a config)."""

    policy: str = _CONFIG_DEFAULTS.policy
    """milp | heuristic | megatrain | ideal (`POLICIES`)."""
    backend: str = _CONFIG_DEFAULTS.backend
    """MILP solver: auto | highs | scip (milp only; the LP bound uses HiGHS when installed)."""
    time_limit_s: float = _CONFIG_DEFAULTS.time_limit_s
    """Solver wall-clock limit, s; the heuristic start gets HEURISTIC_TIME_SHARE of it."""
    gap: float = _CONFIG_DEFAULTS.gap
    """Relative MILP gap at which the solver stops."""
    threads: int = _CONFIG_DEFAULTS.threads
    """Solver threads (1: deterministic plans)."""
    seed: int = _CONFIG_DEFAULTS.seed
    """Solver random seed."""
    deterministic: bool = _CONFIG_DEFAULTS.deterministic
    """Node and step limits instead of wall-clock limits, no solve time in the plan
    (`planner.deterministic`): the same input gives the same plan JSON on any load."""
    megatrain_k: int = _CONFIG_DEFAULTS.megatrain_k
    """K of the MegaTrain rule (policy megatrain)."""
    least_wear_slack: float | None = (_CONFIG_DEFAULTS.least_wear_slack
                                      if _CONFIG_DEFAULTS.least_wear else None)
    """Relative step slack of the MILP's least-wear phase (`planner/wear.py`); None: no such
    phase (config `planner.least_wear: false`)."""
    lp_bound: bool = True
    """Compute the LP-relaxation bound (one more solve; skipped when no solver package is
    installed). The scaling table, the batch search and re-plans turn it off."""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"planner.policy must be one of {POLICIES}; got {self.policy!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"planner.backend must be one of {BACKENDS}; got "
                             f"{self.backend!r}")

    def replace(self, **changes) -> "PlannerOptions":
        """A copy with `changes` (e.g. `policy="heuristic", lp_bound=False`)."""
        return dataclasses.replace(self, **changes)


def planner_options(planner: PlannerConfig) -> PlannerOptions:
    """The `PlannerOptions` of a config's `planner:` section (the only place they are read).

    Args:
        planner: `RunConfig.planner`.
    """
    return PlannerOptions(policy=planner.policy, backend=planner.backend,
                          time_limit_s=planner.time_limit_s, gap=planner.gap,
                          threads=planner.threads, seed=planner.seed,
                          deterministic=planner.deterministic,
                          megatrain_k=planner.megatrain_k,
                          least_wear_slack=planner.least_wear_slack if planner.least_wear
                          else None)


def plan(problem: PlanningProblem, options: PlannerOptions | None = None,
         warm_start: Plan | None = None) -> Plan:
    """Plan `problem` with `options.policy` and attach the bounds (module docstring).

    Args:
        problem: the planning problem.
        options: policy and solver options (None: `PlannerOptions()`, the config's defaults).
        warm_start: a plan whose decisions may start the search (milp, heuristic): used when,
            re-evaluated under `problem`, it fits and beats the heuristic plan. megatrain and
            ideal ignore it (they are rules).

    Returns:
        Plan with `bounds` filled (`lp_step_ms` None when `options.lp_bound` is False).

    Raises:
        PlanInfeasibleError: (milp) no plan fits the HBM, DRAM or NVMe budget.
    """
    opts = options or PlannerOptions()
    problem = choose_weight_paths(problem)  # each block's weight path, then the plan
    chosen = _plan(problem, opts, warm_start)
    _refuse_pinned_overrun(problem, chosen)
    return _without_solve_times(chosen) if opts.deterministic else chosen


def _refuse_pinned_overrun(problem: PlanningProblem, chosen: Plan) -> None:
    """Raise PlanInfeasibleError (budget DRAM) when `chosen` claims to fit (no recorded
    violation) but its predicted pinned host bytes pass the runtime's pinned limit
    (`budgets.plan_budgets`): the ledger would stop that plan mid-step. The DRAM row and the
    evaluator count the same NVMe bounce buffers (`planner/staging.py`), so this never fires
    for a plan they passed; it guards the agreement."""
    over = pinned_overrun_bytes(chosen)
    if over <= 0 or chosen.provenance.get("violations"):
        return
    limit = plan_budgets(chosen)[1]
    raise PlanInfeasibleError(
        shortfalls=(Shortfall(budget="DRAM", window=None, short_bytes=over,
                              need_bytes=limit + over, budget_bytes=limit),),
        proven=False, plan=chosen, fixes={"DRAM": shortfall_fix("DRAM", problem)})


def _plan(problem: PlanningProblem, opts: PlannerOptions, warm_start: Plan | None) -> Plan:
    """`plan` with its options given. Without a solver package the LP bound is left out (the
    memory, roofline and ideal figures need none) and policy milp returns the heuristic plan
    with provenance `milp_unavailable`."""
    solvers = installed_backends()
    bounds = _bounds(problem, lp=opts.lp_bound and bool(solvers),
                     lp_time_limit_s=solver_limits(opts)["time_limit_s"])
    if opts.policy == "megatrain":
        return dataclasses.replace(heuristics.megatrain_plan(problem, k=opts.megatrain_k),
                                   bounds=bounds)
    if opts.policy == "ideal":
        return dataclasses.replace(heuristics.ideal_plan(problem), bounds=bounds)
    start = _start(problem, opts, warm_start)
    if opts.policy == "heuristic":
        return dataclasses.replace(start, bounds=bounds)
    if not solvers:
        return dataclasses.replace(start, bounds=bounds, provenance={
            **start.provenance, "milp_unavailable": MILP_UNAVAILABLE})
    solved = solve_milp(problem, backend=opts.backend, **solver_limits(opts),
                        gap=opts.gap, threads=opts.threads, seed=opts.seed, warm_start=start,
                        bounds=bounds, least_wear_slack=opts.least_wear_slack)
    # a least-wear plan may be up to its slack slower than the start (it is held to that)
    allowed = 1.0 + (opts.least_wear_slack if "least_wear" in solved.provenance else 0.0)
    if start.predicted is None or "violations" in start.provenance \
            or solved.predicted.step_ms <= start.predicted.step_ms * allowed:
        return dataclasses.replace(solved, bounds=bounds)
    # the start's step against the same best bound the solver's gap used
    g = solved.solver.gap
    best = (solved.predicted.step_ms / (1 + g)) if g is not None else None
    record = dataclasses.replace(
        solved.solver, status=f"{solved.solver.status}; {_kept(start)} kept",
        gap=gap_against_best_bound(start.predicted.step_ms, best,
                                   best_claimed_bound_ms(bounds)))
    return dataclasses.replace(start, solver=record, bounds=bounds)


def _start(problem: PlanningProblem, opts: PlannerOptions, warm_start: Plan | None) -> Plan:
    """The heuristic plan, or `warm_start` re-evaluated under `problem` when it fits and is
    predicted faster (or the heuristic's plan breaks a budget)."""
    budget_s = max(HEURISTIC_MIN_S, opts.time_limit_s * HEURISTIC_TIME_SHARE)
    start = heuristics.heuristic_plan(
        problem, time_budget_s=budget_s,
        max_steps=math.ceil(budget_s * HEURISTIC_STEPS_PER_S) if opts.deterministic else None)
    if warm_start is None:
        return start
    again = build_plan(problem, _warm_levels(problem, Decisions.from_plan(warm_start)),
                       solver=SolveRecord(backend="manual", status="warm start re-evaluated"))
    if "violations" not in again.provenance and (
            "violations" in start.provenance or again.predicted.step_ms < start.predicted.step_ms):
        return again
    return start


def _warm_levels(problem: PlanningProblem, decisions: Decisions) -> Decisions:
    """A warm start's decisions with save levels fit for `problem`: given greedily
    (`heuristics.greedy_levels`, as the heuristic's own plan gets them) where the problem
    offers levels, so a re-plan from a plan without them is not priced with the full
    re-forward; dropped (every block L0) where it offers none (`planner.save_levels` off)."""
    if problem.saved_bytes:
        return heuristics.greedy_levels(problem, decisions)
    if decisions.save_levels and set(decisions.save_levels) != {"L0"}:
        L = problem.num_blocks
        return dataclasses.replace(decisions, save_levels=("L0",) * L,
                                   saved_tiers=("none",) * L, internal_transfers=())
    return decisions


def _without_solve_times(chosen: Plan) -> Plan:
    """`chosen` with every recorded solve time (the `solver` record's and any provenance
    record's `solve_s`) set to 0: the one wall-clock figure a deterministic plan would carry."""
    prov = {key: ({**value, "solve_s": 0.0} if isinstance(value, dict) and "solve_s" in value
                  else value) for key, value in chosen.provenance.items()}
    solver = chosen.solver and dataclasses.replace(chosen.solver, solve_s=0.0)
    return dataclasses.replace(chosen, solver=solver, provenance=prov)


def solver_limits(opts: PlannerOptions) -> dict:
    """{"time_limit_s": s, "node_limit": nodes or None} of each solver phase: the wall-clock
    `time_limit_s`, or under `deterministic` no time limit (math.inf) and
    DETERMINISTIC_NODES_PER_S x `time_limit_s` nodes."""
    if not opts.deterministic:
        return {"time_limit_s": opts.time_limit_s, "node_limit": None}
    return {"time_limit_s": math.inf,
            "node_limit": math.ceil(opts.time_limit_s * DETERMINISTIC_NODES_PER_S)}


def _kept(start: Plan) -> str:
    return "warm start" if start.solver is not None and start.solver.backend == "manual" \
        else "heuristic"


def _bounds(problem: PlanningProblem, *, lp: bool, lp_time_limit_s: float) -> Bounds:
    """The plan's reference step times; the LP relaxation goes to HiGHS when it is installed
    (an LP solver), else SCIP, whichever backend the MILP itself uses (`lp` is False when
    neither is installed)."""
    lp_backend = (installed_backends() or ("scip",))[0]
    return compute_bounds(problem, lp=lp, backend=lp_backend, lp_time_limit_s=lp_time_limit_s)
