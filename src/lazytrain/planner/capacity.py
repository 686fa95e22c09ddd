"""Resource calculator: the largest batch that fits a machine, and its predicted throughput.

Owns the batch search behind `lazytrain plan --max-batch`. Everything comes from the planner's
own memory and time model (no hand formula): a micro-batch fits when the chosen planner policy
returns a plan without capacity violations (HBM in every window, DRAM, NVMe) for the problem
built at that micro-batch; its throughput is that plan's evaluated tokens/s.

Gradient accumulation repeats a micro-batch's windows without holding more memory (the host
gradient accumulators are part of the per-parameter states), so feasibility depends on the
micro-batch only, and the largest global batch is max_micro_batch x the largest accumulation
candidate. The optimal plan for (micro_batch, grad_accum) does not depend on grad_accum (the
objective is grad_accum x sum of windows + a constant), so one plan per micro-batch is
evaluated at every accumulation candidate.

Search: double the micro-batch from 1 until the policy finds no feasible plan, then bisect
between the last feasible and the first infeasible one. This assumes feasibility is monotone in
the micro-batch (every byte term grows with it); with the heuristic policy it is the heuristic's
feasibility, which can be stricter than the MILP's.

Knows no torch and no solver: plans through `policy.plan`. The table's text is
`report/capacity.py`'s.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

from lazytrain.planner.evaluate import evaluate
from lazytrain.planner.infeasible import PlanInfeasibleError
from lazytrain.planner.plan import Plan
from lazytrain.planner.policy import PlannerOptions
from lazytrain.planner.policy import plan as plan_problem
from lazytrain.planner.problem import PlanningProblem

MAX_MICRO_BATCH = 1 << 16
"""Upper end of the doubling search, sequences (a machine that fits more is reported as this)."""

ProblemAt = Callable[[int, int], PlanningProblem]
"""(micro_batch, grad_accum) -> the planning problem of the run at that batch shape."""


@dataclass(kw_only=True, frozen=True, slots=True)
class BatchRow:
    """One (micro_batch, grad_accum) candidate of the throughput table."""

    micro_batch: int
    """Sequences per micro-batch."""
    grad_accum: int
    """Micro-batches per optimizer step."""
    global_batch: int
    """micro_batch x grad_accum, sequences per optimizer step."""
    feasible: bool
    """A plan fits every budget (HBM, DRAM, NVMe)."""
    step_ms: float | None = None
    """Predicted optimizer-step time, ms (None when infeasible)."""
    tokens_per_s: float | None = None
    model_tflops: float | None = None
    peak_hbm_bytes: float | None = None
    dram_bytes: float | None = None
    q8_param_fraction: float | None = None
    """Fraction of parameters the plan keeps with 8-bit Adam moments."""
    violation: str | None = None
    """The first capacity violation of an infeasible candidate."""


@dataclass(kw_only=True, frozen=True, slots=True)
class BatchSearch:
    """Result of `max_batch_search`."""

    max_micro_batch: int
    """Largest feasible micro-batch (0: not even one sequence fits)."""
    grad_accums: tuple[int, ...]
    max_global_batch: int
    """max_micro_batch x max(grad_accums)."""
    policy: str
    rows: tuple[BatchRow, ...]
    """Candidates in (micro_batch, grad_accum) order, ending with the first infeasible
    micro-batch (max_micro_batch + 1) unless the search hit MAX_MICRO_BATCH."""
    probes: tuple[int, ...]
    """Micro-batches planned during the search, in order."""

    def to_dict(self) -> dict:
        """Plain data for `--json`."""
        return {"max_micro_batch": self.max_micro_batch, "grad_accums": list(self.grad_accums),
                "max_global_batch": self.max_global_batch, "policy": self.policy,
                "probes": list(self.probes), "rows": [asdict(r) for r in self.rows]}


def plan_fits(problem: PlanningProblem, options: PlannerOptions
              ) -> tuple[Plan | None, str | None]:
    """(plan, None) when `options.policy` finds a plan within every budget, else
    (None, violation).

    Args:
        problem: the planning problem at one batch shape.
        options: planner options; policy "milp" or "heuristic" (those that respect budgets).
            No LP bound is computed and no least-wear phase runs.
    """
    try:
        # a probe asks whether a plan fits: no LP bound, no least-wear phase
        plan = plan_problem(problem, options.replace(lp_bound=False, least_wear_slack=None))
    except PlanInfeasibleError as exc:
        return None, str(exc)
    violations = plan.provenance.get("violations") or []
    return (None, violations[0]) if violations else (plan, None)


def max_micro_batch(problem_at: ProblemAt, options: PlannerOptions, *, grad_accum: int = 1
                    ) -> tuple[int, dict[int, tuple[Plan | None, str | None]]]:
    """The largest micro-batch with a feasible plan under `options`: doubling, then bisection.

    Returns:
        (max micro-batch or 0, {probed micro-batch: plan_fits result}).
    """
    seen: dict[int, tuple[Plan | None, str | None]] = {}

    def fits(m: int) -> bool:
        if m not in seen:
            seen[m] = plan_fits(problem_at(m, grad_accum), options)
        return seen[m][0] is not None

    if not fits(1):
        return 0, seen
    lo = 1
    while lo < MAX_MICRO_BATCH and fits(min(2 * lo, MAX_MICRO_BATCH)):
        lo = min(2 * lo, MAX_MICRO_BATCH)
    if lo == MAX_MICRO_BATCH:
        return lo, seen
    hi = 2 * lo  # infeasible
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo, seen


def _row(problem: PlanningProblem, plan: Plan | None, violation: str | None, m: int,
         g: int) -> BatchRow:
    if plan is None:
        return BatchRow(micro_batch=m, grad_accum=g, global_batch=m * g, feasible=False,
                        violation=violation)
    ev = evaluate(problem, plan)
    pr = ev.predicted
    return BatchRow(micro_batch=m, grad_accum=g, global_batch=m * g, feasible=ev.feasible,
                    step_ms=ev.step_ms, tokens_per_s=ev.tokens_per_s,
                    model_tflops=ev.model_tflops, peak_hbm_bytes=ev.peak_hbm_bytes,
                    dram_bytes=ev.dram_bytes, q8_param_fraction=pr.q8_param_fraction,
                    violation=(ev.violations[0] if ev.violations else None))


def max_batch_search(problem_at: ProblemAt, options: PlannerOptions | None = None, *,
                     grad_accums=(1,)) -> BatchSearch:
    """The largest feasible batch and the predicted throughput of candidate batches.

    Args:
        problem_at: builds the problem at (micro_batch, grad_accum) (e.g. from a run config).
        options: planner options (None: `PlannerOptions(policy="heuristic")`); policy
            "heuristic" (fast) or "milp" (each probe is a solve).
        grad_accums: accumulation candidates, each >= 1; the table has every micro-batch
            candidate at each of them.

    Returns:
        `BatchSearch` whose rows cover micro-batches 1, 2, 4, ... up to the maximum, the
        maximum itself, and the first infeasible micro-batch (maximum + 1).

    Raises:
        ValueError: a grad_accum candidate < 1 or a policy that ignores budgets.
    """
    options = options or PlannerOptions(policy="heuristic")
    policy = options.policy
    if policy not in ("heuristic", "milp"):
        raise ValueError(f"planner.policy: --max-batch needs milp or heuristic; got {policy!r}")
    accums = tuple(sorted(set(int(g) for g in grad_accums)))
    if not accums or accums[0] < 1:
        raise ValueError(f"grad_accum candidates must be >= 1; got {grad_accums!r}")
    best, seen = max_micro_batch(problem_at, options, grad_accum=accums[0])
    sizes = sorted({1 << k for k in range(best.bit_length()) if 1 << k <= best} | (
        {best} if best else set()) | ({best + 1} if best < MAX_MICRO_BATCH else set()))
    rows = []
    for m in sizes:
        if m not in seen:
            seen[m] = plan_fits(problem_at(m, accums[0]), options)
        plan, why = seen[m]
        rows += [_row(problem_at(m, g), plan, why, m, g) for g in accums]
    return BatchSearch(max_micro_batch=best, grad_accums=accums,
                       max_global_batch=best * accums[-1], policy=policy, rows=tuple(rows),
                       probes=tuple(seen))
