"""The least-wear phase of the MILP: among the plans about as fast as the fastest found, the one
that writes the fewest bytes to NVMe, then moves the fewest activation bytes over the host link.

Why a second solve: when every window is compute-bound many placements tie on the step, and
the MILP picks any of them; on the seed scenario (Qwen3.5-27B, h800-paper) one of its answers
put 49 of 65 boundaries on NVMe (2 in HBM), 37.0 GB written per step, where a plan with 12 in
HBM and 39 on NVMe (29.4 GB) has the same step to the microsecond (this phase finds it). A
tie-breaker in the first objective cannot fix that: it must stay far below the solver's gap to
leave the step alone (`milp_inputs.TIE_REL`), so the search stops before it matters. This
phase is lexicographic instead (first the step, then the wear):

    phase 1 (`milp_solve.solve_milp`): T* = the step of the faster of the solver's plan and the warm
        start, ms.
    phase 2 (`least_wear_plan`), on the same model with the objective replaced:
        min   sum_i ga A[i] (W nvme[i] + 2 (dram[i] + nvme[i]))          GB per step
        s.t.  every row of the placement model (budgets hard) and
              step(x) <= (1 + slack) T*                                   wear_step_cap
              sum_j Q[j] q8[j] <= sum_j Q[j] q8*[j]                        wear_q8_cap
    step(x) is phase 1's objective without tie-breakers and penalties (ga sum_o t[o] plus the
    constant terms: the evaluator's step, ms); A[i] boundary bytes (GB), ga the micro-batches
    per step; nvme[i] is written once per
    micro-batch, and every offloaded boundary (dram or nvme) crosses the host link twice
    (D2H, then H2D). W = 1 + 2 sum_i A[i] / min_i A[i] (`wear_weight`): one boundary fewer on
    NVMe outweighs any change in host traffic, so the weighted sum orders plans as the
    lexicographic pair (NVMe bytes written, host bytes) does for equal-sized boundaries (every
    boundary of a transformer is [micro_batch, seq, hidden]). The q8 row keeps the 8-bit share
    of the states no larger than the first plan's: DRAM freed by 8-bit moments must not be
    bought with update quality the first objective did not choose.

The solver starts from the phase-1 plan improved by single-boundary moves (`moved_plan`): each
nvme boundary in turn to hbm, dram or recompute, then each dram boundary to hbm or recompute,
twice, keeping every other transfer and accepting a move when the evaluator says the plan
still fits and stays within the cap. The moves find the cheap wins the solver may not reach in
its share of the time (on the seed, re-embedding boundary 0 instead of writing it to NVMe);
the solver then looks for the rearrangements no single move reaches. Either way the start
satisfies both rows, so the phase returns a plan at least as good in wear; the solver gets its
own share of the time limit (`WEAR_TIME_SHARE`). The returned
plan is evaluated like every plan (`evaluate.build_plan`), its step is checked against the cap,
and its gap is that step against the best bound phase 1 proved (a lower bound on every plan, so
it stays a bound after phase 2). Knows no torch; the solver goes through `solvers.solve`.
"""

from __future__ import annotations

import dataclasses
import math
import time

from lazytrain.planner.evaluate import Decisions, Evaluation, build_plan, evaluate
from lazytrain.planner.extract import extract_plan, start_from_plan
from lazytrain.planner.gaps import gap_against_best_bound
from lazytrain.planner.milp import Milp, build_milp
from lazytrain.planner.milp_vars import row_name
from lazytrain.planner.plan import Bounds, Plan, SolveRecord
from lazytrain.planner.problem import PlanningProblem
from lazytrain.planner.solvers import solve

WEAR_TIME_SHARE = 0.05
"""Share of `planner.time_limit_s` (and of a `planner.deterministic` node limit) the least-wear
solve may use: 0.5 s at the default 10 s. On the seed scenario (Qwen3.5-27B, h800-paper, 64
blocks; 2 shared cores, 2026-12-02) the moves took 0.33 s of CPU, the model 0.17 s, and HiGHS
improved on the moves' plan neither in 1.5 s nor in 3 s (from the 39 NVMe boundaries of the
step-time plan it reached and proved the moves' 38 in 29 s), so a short solve costs little
and still finds the rearrangements of small problems, which it solves to the end; planning
without the phase took 2.1 s of CPU."""
WEAR_GAP = 1e-3
"""Relative gap of the least-wear solve (on its weighted GB objective): 3.8 of the seed's 3779,
where one boundary on NVMe weighs 99, so the solver stops only once no boundary can leave."""
STEP_CAP_TOL = 1e-9
"""Relative tolerance of the cap check on the evaluated step (float rounding of ms sums)."""
MOVE_ROUNDS = 2
"""Passes of single-boundary moves before the solve: a second pass moves nvme boundaries into
the DRAM the first pass freed (dram -> hbm or recompute)."""
MOVES = (("nvme", ("hbm", "dram", "recompute")), ("dram", ("hbm", "recompute")))
"""For each tier the moves tried, in order of preference: least wear, then least host
traffic, then the tier that costs no recompute."""
KEPT_TRANSFERS = {"hbm": (), "recompute": (), "dram": ("d2h", "h2d")}
"""A moved boundary's transfers that stay (an nvme boundary kept in DRAM keeps its D2H and H2D
and drops its NVMe write and read)."""


def wear_weight(problem: PlanningProblem) -> float:
    """W = 1 + 2 sum_i A[i] / min_i A[i] over the boundaries 0..L-1 with A[i] > 0 (unitless).

    Moving one boundary off NVMe saves at least min A[i] of writes; all host traffic is at most
    2 sum A[i]; so with this weight fewer NVMe bytes always win over less host traffic (for
    equal-sized boundaries exactly; see the module docstring).
    """
    sizes = [a for a in problem.boundary_bytes[:problem.num_blocks] if a > 0]
    if not sizes:
        return 1.0
    return 1.0 + 2.0 * math.fsum(sizes) / min(sizes)


def nvme_bytes_per_step(problem: PlanningProblem, plan: Plan) -> float:
    """Bytes a step writes to NVMe: grad_accum x the A[i] of every nvme-tier boundary."""
    return problem.grad_accum * math.fsum(
        problem.boundary_bytes[i] for i, tier in enumerate(plan.tiers) if tier == "nvme")


def least_wear_plan(problem: PlanningProblem, reference: Plan, *, slack: float, backend: str,
                    time_limit_s: float, threads: int = 1, seed: int = 0,
                    node_limit: int | None = None, dual_bound_ms: float | None = None,
                    lp_bound_ms: float | None = None, bounds: Bounds | None = None
                    ) -> Plan | None:
    """The plan within `slack` of `reference`'s step that writes the least NVMe, then moves the
    least host traffic (module docstring); None when none is found that beats `reference`.

    Args:
        problem: the planning problem.
        reference: the phase-1 plan (fits every budget; its step is T*, ms).
        slack: relative step slack, >= 0 (0.001: up to 0.1% slower than T*).
        backend: "highs" or "scip".
        time_limit_s: this solve's wall-clock limit, s.
        threads, seed: solver threads and seed (defaults: deterministic).
        node_limit: branch-and-bound node limit of this solve (None: none).
        dual_bound_ms, lp_bound_ms: bounds on every plan's step known from phase 1 and the LP
            relaxation, ms: the returned plan's gap is its step against the larger.
        bounds: filled into the plan as given.

    Returns:
        The plan (solver record: the least-wear solve's backend and status, solve_s the
        phase's seconds (moves, model and solve), `gap` as above;
        provenance `least_wear`: slack, reference step in ms, NVMe bytes written per step
        before and after, solve status; no seconds, so a `planner.deterministic` plan stays a
        function of its input), or None: nothing written to NVMe less and no host traffic
        saved.

    Raises:
        ValueError: slack < 0.
    """
    if slack < 0:
        raise ValueError(f"planner.least_wear_slack must be >= 0; got {slack}")
    if reference.predicted is None or reference.provenance.get("violations"):
        return None
    t0 = time.perf_counter()
    cap_ms = (1.0 + slack) * reference.predicted.step_ms
    moved = moved_plan(problem, reference, cap_ms=cap_ms)
    milp = wear_milp(problem, cap_ms=cap_ms, reference=reference)
    res = solve(milp.model, backend=backend, time_limit_s=time_limit_s, gap=WEAR_GAP,
                threads=threads, seed=seed, start=start_from_plan(milp, moved),
                node_limit=node_limit)
    found = [moved] if res.values is None else [
        moved, extract_plan(milp, res.values, solver=SolveRecord(backend=res.backend))]
    plan = min((q for q in found if not q.provenance.get("violations")
                and q.predicted.step_ms <= cap_ms * (1 + STEP_CAP_TOL)),
               key=lambda q: _wear_key(problem, q))  # the moves' plan always qualifies
    if _wear_key(problem, plan) >= _wear_key(problem, reference):
        return None
    solve_s = time.perf_counter() - t0
    record = SolveRecord(backend=res.backend, status=res.status, solve_s=solve_s,
                         gap=gap_against_best_bound(plan.predicted.step_ms, dual_bound_ms,
                                                    lp_bound_ms),
                         num_vars=milp.model.num_vars, num_rows=milp.model.num_rows)
    wear = {"step_slack": slack, "reference_step_ms": reference.predicted.step_ms,
            "nvme_write_bytes_per_step": {"before": nvme_bytes_per_step(problem, reference),
                                          "after": nvme_bytes_per_step(problem, plan)},
            "status": res.status}
    return dataclasses.replace(plan, solver=record, bounds=bounds or Bounds(),
                               provenance={**plan.provenance, "least_wear": wear})


def _wear_key(problem: PlanningProblem, plan: Plan) -> tuple[float, float, float]:
    """(NVMe bytes written, host bytes, step ms) per step: the phase's order of plans."""
    return (nvme_bytes_per_step(problem, plan), host_bytes_per_step(problem, plan),
            plan.predicted.step_ms)


def host_bytes_per_step(problem: PlanningProblem, plan: Plan) -> float:
    """Activation bytes a step moves over the host link: grad_accum x 2 A[i] (D2H and H2D) of
    every dram- or nvme-tier boundary."""
    return problem.grad_accum * math.fsum(
        2 * problem.boundary_bytes[i] for i, tier in enumerate(plan.tiers)
        if tier in ("dram", "nvme"))


def moved_plan(problem: PlanningProblem, plan: Plan, *, cap_ms: float) -> Plan:
    """`plan` after the single-boundary moves of `MOVES` (boundaries in order; a second pass
    only when the first moved a boundary out of DRAM, up to `MOVE_ROUNDS`): a move changes one
    boundary's tier, keeps its `KEPT_TRANSFERS` and every other decision, and stays when the
    plan still obeys the contract, fits every budget and its evaluated step is at most `cap_ms`
    (ms). Boundary L stays put, and the end of a kept or resident block is never recomputed
    (such a block must end its segment, as the MILP's rows say). Once DRAM overflows, no
    boundary at least as large is tried in DRAM until a move frees some (DRAM holds for the
    whole step)."""
    A = problem.boundary_bytes
    for _ in range(MOVE_ROUNDS):
        dram_freed, too_big = False, math.inf
        for tier, targets in MOVES:
            for i in range(problem.num_blocks):
                if plan.tiers[i] != tier:
                    continue
                ends_block = (i - 1) in plan.keep_internals or (i - 1) in plan.resident_weights
                for to in (t for t in targets if (t != "dram" or A[i] < too_big)
                           and (t != "recompute" or not ends_block)):
                    moved, ev = _moved(problem, plan, i, to, cap_ms=cap_ms)
                    if moved is not None:
                        plan, dram_freed = moved, dram_freed or tier == "dram"
                        too_big = math.inf if tier == "dram" else too_big
                        break
                    if to == "dram" and ev is not None and ev.dram_short_bytes > 0:
                        too_big = min(too_big, A[i])
        if not dram_freed:
            break
    return plan


def _moved(problem: PlanningProblem, plan: Plan, i: int, tier: str, *, cap_ms: float
           ) -> tuple[Plan | None, Evaluation | None]:
    """(`plan` with boundary i in `tier`, or None when that breaks a rule; its evaluation, None
    when the move breaks the contract)."""
    tiers = plan.tiers[:i] + (tier,) + plan.tiers[i + 1:]
    kept = KEPT_TRANSFERS[tier]
    decisions = dataclasses.replace(Decisions.from_plan(plan), tiers=tiers, transfers=tuple(
        t for t in plan.transfers if t.boundary != i or t.kind in kept))
    try:
        ev = evaluate(problem, decisions)
        if ev.violations or ev.predicted.step_ms > cap_ms * (1 + STEP_CAP_TOL):
            return None, ev
        return build_plan(problem, decisions, solver=plan.solver), ev
    except ValueError:  # PlanValidationError: a transfer no longer legal for the new segment
        return None, None


def wear_milp(problem: PlanningProblem, *, cap_ms: float, reference: Plan) -> Milp:
    """The placement model with the least-wear objective and the two cap rows (module
    docstring): objective in GB per step, the step capped at `cap_ms` (ms) and the 8-bit
    saving at `reference`'s (GB)."""
    milp = build_milp(problem, tie_breakers=False, q8_penalty=False)
    m, v, p = milp.model, milp.v, milp.p
    # without tie-breakers and penalties the objective is the evaluator's step (ms)
    step = {c: a for c, a in enumerate(m.obj) if a}
    m.add_row(row_name("wear_step_cap", "all"), step, ub=cap_ms - m.obj_offset)
    m.obj = [0.0] * m.num_vars
    m.obj_offset = 0.0
    weight = wear_weight(problem)
    for i in range(p.L):
        for fam, coef in ((v.dram, 2.0), (v.nvme, 2.0 + weight)):
            if i in fam:
                m.add_obj(fam[i], p.grad_accum * p.A[i] * coef)
    if v.q8:
        q8_gb = math.fsum(p.q8_saving[j] for j in reference.q8_blocks)
        m.add_row(row_name("wear_q8_cap", "all"), {c: p.q8_saving[j] for j, c in v.q8.items()},
                  ub=q8_gb * (1 + STEP_CAP_TOL))
    return milp

