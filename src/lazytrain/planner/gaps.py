"""Optimality gaps of a plan: its evaluated step against the best lower bound known, and the
Plan JSON `solver` record of one solve of the placement model (`milp.build_milp`).

The bounds are the solver's dual bound read as a bound on the step (`dual_step_bound_ms`: the
objective less what its tie-breakers and penalties can add) and the plan's claimed bounds (LP
relaxation, memory, roofline: `best_claimed_bound_ms`). Used by every MILP phase
(`planner/milp_solve.py`, `planner/wear.py`) and by the policy when it keeps its start. Knows no
solver package and no torch.
"""

from __future__ import annotations

import math

from lazytrain.planner.milp import Milp
from lazytrain.planner.plan import Bounds, SolveRecord
from lazytrain.planner.solvers import SolveResult


def gap_against_best_bound(step_ms: float | None, dual_bound_ms: float | None,
                           bound_ms: float | None) -> float | None:
    """(step - best bound) / best bound with best bound = max(dual bound, `bound_ms`), unclamped.

    `step_ms` is the evaluated step of the plan that is returned, `dual_bound_ms` a step-time
    bound from the solver (`dual_step_bound_ms`), `bound_ms` the best claimed closed-form/LP
    bound (`best_claimed_bound_ms`). A solver stopped before its first dual bound (a node limit of
    1, a very short time limit) reports none or a trivial one; the LP relaxation bound is valid
    for every plan, so the gap is never worse than against it. A negative gap means a bound lies
    above the plan: a modelling error that is shown, not hidden by a clamp. None when no bound is
    known (or positive).
    """
    known = [b for b in (dual_bound_ms, bound_ms) if b is not None and math.isfinite(b)
             and b > 0]
    if step_ms is None or not known:
        return None
    best = max(known)
    return (step_ms - best) / best


def best_claimed_bound_ms(bounds: Bounds | None) -> float | None:
    """The largest of the plan's lower bounds (LP relaxation, memory, roofline), ms; None when
    none is known. `ideal_step_ms` is a reference, not a bound, and is left out."""
    if bounds is None:
        return None
    known = [b for b in (bounds.lp_step_ms, bounds.memory_step_ms, bounds.roofline_step_ms)
             if b is not None and math.isfinite(b)]
    return max(known) if known else None


def dual_step_bound_ms(milp: Milp, dual_bound: float | None) -> float | None:
    """A bound on the step time of every plan from the solver's bound on its objective, ms.

    The objective is `step_ms` plus the tie-breakers and 8-bit penalties, each a non-negative
    coefficient on a column bounded above, so objective - step <= sum_c obj[c] ub[c] over the
    columns other than t[o]; subtracting that keeps the dual bound a bound on the step (it is
    loose where 8-bit penalties are large; the LP bound then decides). None without a dual bound.
    """
    if dual_bound is None or not math.isfinite(dual_bound):
        return None
    m, times = milp.model, set(milp.v.t.values())
    in_step = {c: milp.p.q8_update[j] for j, c in milp.v.q8.items()}  # U8[j]: part of the step
    extra = math.fsum(max(0.0, m.obj[c] - in_step.get(c, 0.0)) * m.var_ub[c]
                      for c in range(m.num_vars) if c not in times and m.obj[c] != 0.0)
    return dual_bound - extra


def solve_record(milp: Milp, res: SolveResult, *, lp_bound_ms: float | None = None,
                 step_ms: float | None = None) -> SolveRecord:
    """The Plan JSON `solver` object of one solve.

    Its gap is `step_ms` (the returned plan's evaluated step; the solver's objective when not
    given) against the best bound known: the solver's dual bound read as a step bound
    (`dual_step_bound_ms`) or `lp_bound_ms` (the best claimed bound), unclamped.
    """
    step = step_ms if step_ms is not None else res.objective
    return SolveRecord(backend=res.backend, status=res.status, solve_s=res.solve_s,
                       gap=gap_against_best_bound(step, dual_step_bound_ms(milp, res.dual_bound),
                                                  lp_bound_ms),
                       num_vars=milp.model.num_vars, num_rows=milp.model.num_rows)
