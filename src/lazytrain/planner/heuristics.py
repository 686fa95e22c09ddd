"""Rule-based and heuristic plans: MegaTrain's every-K rule, uniform-K, ideal, and the greedy.

`heuristic_plan` always returns a plan (the MILP's warm start and its time-out fallback, and
the baseline the MILP's gain is quoted against, so it must not leave easy gains to the MILP):
uniform-K starts with lifetime-ordered tiers (latest boundaries hbm while HBM fits, earlier
ones dram while DRAM fits, the earliest nvme), the transfer schedule of
`schedule.schedule_transfers`; rule-based starts: keep-internals greedily from the last block
down (`keep_suffix`), resident weights where they save most (`resident_fill`) and, when 8-bit
states are offered, every block 8-bit so that DRAM holds every boundary (then the 8-bit states
DRAM does not need are dropped, `q8_trim`); a greedy repair when a capacity is violated and a
first-improvement local search (`planner/search.py`, which evaluates candidates); then save
levels L1/L2 where they pay and fit (`greedy_levels`: the heuristic's answer to the MILP's
level choice, so the two compare fairly; the fixed-K rules keep every block L0).
Deterministic: no randomness; the wall-clock budget only truncates the local search (the tests'
problems converge well before it).

Knows no solver and no torch. Source: MegaTrain (arXiv 2604.05091) for the every-K rule.
"""

from __future__ import annotations

import dataclasses
import itertools
import time

from lazytrain.planner.evaluate import Decisions, build_plan, decisions_from_tiers, evaluate
from lazytrain.planner.plan import InternalTransfer, Plan, SolveRecord
from lazytrain.planner.problem import PlanningProblem
from lazytrain.planner.search import Search
from lazytrain.planner.windows import internal_legal_ords, window_name, window_ord

UNIFORM_KS = (1, 2, 3, 4, 6, 8, 12, 16)
"""Segment lengths tried as starts (capped by k_max and L)."""


# ---------------------------------------------------------------------------------------------
# Fixed rules


def megatrain_tiers(num_blocks: int, k: int) -> tuple[str, ...]:
    """Boundaries 0, k, 2k, ... and L in hbm; the rest recompute."""
    return tuple("hbm" if i % k == 0 or i == num_blocks else "recompute"
                 for i in range(num_blocks + 1))


def _finish(problem: PlanningProblem, decisions: Decisions, backend: str, t0: float,
            status: str | None = None) -> Plan:
    plan = build_plan(problem, decisions, solver=SolveRecord(backend=backend))
    if status is None:
        status = "infeasible" if plan.provenance.get("violations") else "ok"
    rec = SolveRecord(backend=backend, status=status, solve_s=time.perf_counter() - t0)
    return dataclasses.replace(plan, solver=rec)


def megatrain_plan(problem: PlanningProblem, k: int = 4, *, as_published: bool = False) -> Plan:
    """MegaTrain's rule: every k-th boundary (and L) in HBM, the rest recomputed, no keep.

    Every block is L0 (the truncated re-forward where the problem has one); `as_published`
    gives the rule as MegaTrain publishes it: no save levels, every block re-forwarded in full
    (docs/execution_model.md, "Save levels"). A plan
    that violates a capacity is still returned with `solver.status == "infeasible"` and
    `provenance["violations"]`.

    Raises:
        ValueError: k < 1 or k > problem.k_max.
    """
    return uniform_plan(problem, k, lifetime_tiers=False, rule="megatrain",
                        save_levels=() if as_published else None)


def best_fixed_k_plan(problem: PlanningProblem, *, as_published: bool = False) -> Plan | None:
    """The MegaTrain rule at the K that fits every budget with the shortest predicted step.

    Tries every K in 1..min(k_max, L) (ties: the smaller K). This is the fair fixed-K
    baseline: the paper's K = 4 may leave HBM unused or not fit at all. `as_published`: the
    rule re-forwards every block in full (`megatrain_plan`).

    Returns:
        The plan (its `solver.backend` is "megatrain"; K is `k_of(plan)`), or None when no K
        fits the budgets.
    """
    best = None
    for k in range(1, min(problem.k_max, problem.num_blocks) + 1):
        plan = megatrain_plan(problem, k, as_published=as_published)
        if plan.provenance.get("violations"):
            continue
        if best is None or plan.predicted.step_ms < best.predicted.step_ms:
            best = plan
    return best


def k_of(plan: Plan) -> int:
    """The segment length K of a MegaTrain-rule plan (its first segment's length)."""
    s, e = plan.segments()[0]
    return e - s


def ideal_plan(problem: PlanningProblem) -> Plan:
    """Infinite-HBM reference: every boundary hbm, every block kept with resident weights.

    Ignores capacities; it is a bound, never a plan to run (`solver.backend == "ideal"`).
    """
    t0 = time.perf_counter()
    L = problem.num_blocks
    d = Decisions(tiers=("hbm",) * (L + 1), keep_internals=tuple(range(L)))
    return _finish(problem, d, "ideal", t0, status="bound: ignores capacities, do not run")


def uniform_plan(problem: PlanningProblem, k: int, *, lifetime_tiers: bool = True,
                 rule: str = "uniform", save_levels: tuple[str, ...] | None = None) -> Plan:
    """Every k-th boundary materialized; tiers by lifetime (or all hbm); no keep, no repair.

    `rule` names the plan's `solver.backend` and the error ("megatrain" for `megatrain_plan`,
    which is this rule with every materialized boundary in hbm). `save_levels` as
    `decisions_from_tiers` takes them (None: every block L0; (): none, the full re-forward).

    Raises:
        ValueError: k < 1 or k > problem.k_max.
    """
    if not 1 <= k <= problem.k_max:
        raise ValueError(f"{rule} k must be in 1..k_max={problem.k_max}; got {k}")
    t0 = time.perf_counter()
    tiers = megatrain_tiers(problem.num_blocks, k)
    if lifetime_tiers:
        tiers = Search(problem, deadline=float("inf")).lifetime(tiers).tiers
    return _finish(problem, decisions_from_tiers(problem, tiers, save_levels=save_levels),
                   rule, t0)


# ---------------------------------------------------------------------------------------------
# Heuristic search


def heuristic_plan(problem: PlanningProblem, *, time_budget_s: float = 2.0,
                   max_steps: int | None = None) -> Plan:
    """Best plan found by uniform-K, keep, resident-weight and all-8-bit starts, lifetime
    tiers, repair and local search.

    Always returns a plan, never slower than the best fixed-K rule that fits
    (`best_fixed_k_plan`). If no candidate fits every capacity, the one with the smallest
    total shortfall is returned with `solver.status == "infeasible"` and the violations in
    `provenance["violations"]`; the caller decides whether to raise.

    Args:
        problem: the planning problem.
        time_budget_s: wall-clock cap on the local search after the starts, s (the starts and
            their repairs always run; the result is deterministic whenever the search converges
            within the cap).
        max_steps: a step budget instead of `time_budget_s` (one step: one repair round or
            one local-search move looked at), so the plan does not depend on how busy the
            machine is (`planner.deterministic`). None: the wall-clock cap.
    """
    t0 = time.perf_counter()
    search = (Search(problem, deadline=float("inf")) if max_steps is None
              else Search(problem, deadline=max_steps, clock=itertools.count(1).__next__))
    L = problem.num_blocks
    every = megatrain_tiers(L, 1)
    starts = [search.build(megatrain_tiers(L, min(4, problem.k_max, L)), ())]
    for k in UNIFORM_KS:
        if k <= min(problem.k_max, L):
            tiers = list(megatrain_tiers(L, k))
            tiers[0] = "recompute"  # re-embedding boundary 0 is nearly free
            starts.append(search.repair(search.lifetime(tuple(tiers))))
    q8s = [(), tuple(range(L))] if problem.allow_q8 else [()]
    for q8 in q8s[1:]:  # 8-bit states everywhere free DRAM for every boundary
        starts.append(search.repair(search.q8_trim(search.lifetime(every, (), q8))))
    if problem.allow_keep:  # keep, then resident weights on the rest; resident, then keep
        kept = min((search.q8_trim(search.keep_suffix(every, q8)) for q8 in q8s),
                   key=lambda s: s.score)
        res = search.resident_fill(min(starts, key=lambda s: s.score))
        for st in (search.resident_fill(kept), res, search.keep_suffix(every, res.q8, res.res)):
            starts.append(search.repair(st))
    if max_steps is None:  # the wall clock caps the local search, never the starts' repairs
        search.deadline = time.perf_counter() + time_budget_s
    best = search.q8_trim(search.local_search(min(starts, key=lambda s: s.score)))
    d = Decisions(tiers=best.tiers, keep_internals=best.keep, resident_weights=best.res,
                  q8_blocks=best.q8, transfers=best.transfers())
    plan = _finish(problem, d, "heuristic", t0)
    fixed = best_fixed_k_plan(problem)  # the search scores with the fluid model; make sure
    if fixed is not None and (plan.provenance.get("violations")  # it beats the baseline
                              or fixed.predicted.step_ms < plan.predicted.step_ms):
        d = Decisions.from_plan(fixed)
    return _finish(problem, greedy_levels(problem, d), "heuristic", t0)


# ---------------------------------------------------------------------------------------------
# Save levels


LEVEL_IMPROVE_REL = 1e-9
"""A level is accepted only when it shortens the step by more than this share of it (float
noise of the evaluator's sums is far below; any real saving is far above)."""


def greedy_levels(problem: PlanningProblem, decisions: Decisions) -> Decisions:
    """`decisions` with save levels L1/L2 given greedily, block by block, where they pay.

    The candidates (block j not kept, level L1 or L2) go in order of the compute they save per
    saved byte: (Fr[j] - Fr1[j] at L1, or Fr[j] at L2) less the autograd forward's extra
    (Fg[j] - F[j]), over S1[j] or S2[j]; a candidate saving nothing is left out. Each is tried
    in the `hbm` tier, else in `dram` with its d2h whole in the earliest legal window (j + 1)
    and its h2d whole in the latest (2L - j - 1; a block with no such pair, j = L - 1, cannot
    take dram), and kept when the evaluator's step drops and the plan still fits every budget
    (an L2 candidate may so replace a block's L1). At most 2 evaluations per candidate, 4L in
    all, and none where the HBM room left cannot hold the internals (`_may_fit`). The tiers,
    keep-internals and transfers are left as they are.

    Args:
        problem: the planning problem; without `saved_bytes` the decisions come back as given.
        decisions: a tier placement (its levels, if any, are the start: L0 elsewhere).

    Returns:
        Decisions with `save_levels`, `saved_tiers` and `internal_transfers` set (unchanged
        when the start breaks a budget: nothing is then known to fit).

    Source: docs/execution_model.md, "Save levels" (costs, legal windows).
    """
    p, L = problem, problem.num_blocks
    if not p.saved_bytes:
        return decisions
    best = _with_levels(decisions, decisions.save_levels or ("L0",) * L,
                        decisions.saved_tiers or ("none",) * L, decisions.internal_transfers)
    cur = evaluate(p, best)
    if not cur.feasible:
        return best
    for j, level in _level_candidates(p, decisions.keep_internals):
        if best.save_levels[j] in (level, "L2"):
            continue  # already there (or beyond)
        for tier in ("hbm", "dram"):
            trial = _set_level(p, best, j, level, tier)
            if trial is None or not _may_fit(p, cur, best, trial, j, level, tier):
                continue
            ev = evaluate(p, trial)
            if ev.feasible and ev.step_ms < cur.step_ms * (1 - LEVEL_IMPROVE_REL):
                best, cur = trial, ev
                break
    return best


def _level_candidates(p: PlanningProblem, keep) -> list[tuple[int, str]]:
    """(block, level) pairs that save compute, by ms saved per byte kept (best first; ties:
    the lower block, then L1)."""
    ranked = []
    for j in range(p.num_blocks):
        if j in keep:
            continue
        extra = p.fwd_grad_ms[j] - p.fwd_ms[j]  # f{j} runs with autograd at L1/L2
        s1, s2 = p.saved_bytes[j]
        for level, nbytes, ms in (("L1", s1, p.reforward_l1_ms[j]), ("L2", s2, 0.0)):
            saved = p.reforward[j] - ms - extra
            if saved > 0:
                ranked.append((-saved / max(nbytes, 1), j, level))
    return [(j, level) for _r, j, level in sorted(ranked)]


def _may_fit(p: PlanningProblem, cur, now: Decisions, trial: Decisions, j: int, level: str,
             tier: str) -> bool:
    """False when block j's internals at `level` in `tier` cannot fit beside the current plan
    (`now`, `cur` its evaluation), so the trial needs no evaluation: HBM has less room than S
    in a window that would hold them (hbm: ords j..2L-j; dram: from j to its d2h window and
    from its h2d window to 2L-j), counting the room block j's own internals free there when
    it already saves them (an L1 block tried at L2 gives its S1 back). The trial changes each
    such window's HBM by at most S less what block j holds there now, so this never rejects a
    trial that fits. (DRAM is a peak over windows, which S may raise by less: left to the
    evaluation.)"""
    size = p.saved_bytes[j][0 if level == "L1" else 1]
    held_now = _held_ords(p, now, j)
    before = (p.saved_bytes[j][0 if now.save_levels[j] == "L1" else 1]
              if now.save_levels[j] != "L0" else 0)
    return all(cur.hbm_by_window[o] - (before if o in held_now else 0) + size <= p.hbm_bytes
               for o in _held_ords(p, trial, j))


def _held_ords(p: PlanningProblem, d: Decisions, j: int) -> set[int]:
    """Window ords in which block j's saved internals are held in HBM under `d` (none at L0;
    hbm: j..2L-j; dram: j..last d2h and first h2d..2L-j; docs/execution_model.md, "Save
    levels")."""
    L = p.num_blocks
    if d.save_levels[j] == "L0":
        return set()
    held = range(j, 2 * L - j + 1)
    if d.saved_tiers[j] != "dram":
        return set(held)
    moves = [(t.kind, window_ord(t.window, L)) for t in d.internal_transfers if t.block == j]
    last = max(o for kind, o in moves if kind == "d2h")
    first = min(o for kind, o in moves if kind == "h2d")
    return {o for o in held if o <= last or o >= first}


def _set_level(p: PlanningProblem, d: Decisions, j: int, level: str,
               tier: str) -> Decisions | None:
    """`d` with block j at `level` in `tier` (dram: whole d2h in the first legal window,
    whole h2d in the last); None when `tier` is dram and no legal pair exists."""
    L = p.num_blocks
    moves = [t for t in d.internal_transfers if t.block != j]
    if tier == "dram":
        d2h = internal_legal_ords("d2h", j, L, drain_windows=p.drain_windows,
                                  prefetch_windows=p.prefetch_windows)
        h2d = internal_legal_ords("h2d", j, L, drain_windows=p.drain_windows,
                                  prefetch_windows=p.prefetch_windows)
        if not d2h or not h2d or h2d[-1] <= d2h[0]:
            return None
        moves += [InternalTransfer(block=j, kind="d2h", window=window_name(d2h[0], L),
                                   fraction=1.0),
                  InternalTransfer(block=j, kind="h2d", window=window_name(h2d[-1], L),
                                   fraction=1.0)]
    levels, tiers = list(d.save_levels), list(d.saved_tiers)
    levels[j], tiers[j] = level, tier
    return _with_levels(d, levels, tiers, moves)


def _with_levels(d: Decisions, levels, tiers, moves) -> Decisions:
    """`d` with these save levels, saved tiers and internal transfers."""
    return dataclasses.replace(d, save_levels=tuple(levels), saved_tiers=tuple(tiers),
                               internal_transfers=tuple(moves))
