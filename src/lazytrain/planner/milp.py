"""The placement MILP: one formulation of docs/execution_model.md, solved by SCIP or HiGHS.

Knows the execution model's equations (the same ones `planner/evaluate.py` implements) and
nothing of torch; talks to solvers only through `solvers.LinearModel` / `solvers.solve`.

This module owns the formulation (this docstring), `build_milp` (its table of contents), the
capacity errors (`PlanInfeasibleError`) and the solve entry `solve_milp`. The parts live by
concern beside it:
    planner/milp_inputs.py   `Scaled`, `scale_inputs`: the parameters below, in model units
    planner/milp_vars.py     `MilpVars`, `add_variables`, `row_name`: the variable families
    planner/milp_loads.py    the window loads and held[o] as linear expressions
    planner/milp_rows.py     the constraint families 1-10, one `add_*` function each
    planner/extract.py       warm starts (`start_from_plan`) and plans from solutions
    planner/feasibility.py   the feasibility phase (`capacity="min_shortfall"`)
    planner/wear.py          the least-wear phase after the step-time solve (`least_wear_slack`)

Index legend
    j      block 0..L-1 (maps boundary j to boundary j+1)
    i, k   boundary 0..L (A[L] always hbm; boundary 0 "recompute" = re-embedded in backward)
    o, w   window ord 0..2L: f_j -> j, turn -> L, b_j -> 2L - j (names f{j}, turn, b{j})
    s, e   segment ends: consecutive segment starts, 0 <= s < e <= L, e - s <= K
    use(e) = 2L - e + 1, the ord of b_{e-1}, where segment (s, e)'s start is first needed

Parameters (units inside the model: ms and GB; converted once in `scale_inputs`)
    F[j], Fg[j], B[j]      forward, forward with autograd, backward, ms
    P[j], G[j], I[j], A[i] weights, gradients, internals, boundary bytes, GB
    bw_h2d, bw_d2h, bw_x, bw_nr, bw_nw   bandwidths, GB/ms (bw_x: H2D + D2H duplex cap)
    host_conv, host_acc    host conversion / accumulation rates, GB/ms (0: not modelled)
    embed, head            embedding (also re-embed) and head compute, ms
    M_hbm = hbm - fixed_hbm; M_dram = dram - staging pools - host states (all 16/12 B/param;
    the pools less the NVMe bounce buffers, counted per window: Ab[i] = align_up(A[i]), GB);
    M_nvme, GB;  Q[j] = params[j] * (bpp - bpp_q8) / 1e9 (8-bit saving), GB
    U8[j]                  the 8-bit update's extra time of block j, ms per step
    H_d, H_p, H_n          drain / prefetch / NVMe-lead horizons (windows), `windows.legal_ords`
    R[s,e]                 recompute chain of segment (s, e): max_k (P[s..k]/bw_h2d + F[k..e-2]),
                           ms (`chains.recompute_chain_ms`)

Variables (`MilpVars`; code name = design symbol)
    seg[s,e]  in {0,1}  x: s and e consecutive segment starts
    mat[i]    in {0,1}  z: boundary i materialized, 0 < i < L
    hbm[i], dram[i], nvme[i] in {0,1}  tier of boundary i < L (none: recompute)
    emb[e]    in [0,1]  boundary 0 is re-embedded for first segment (0, e) (integral given seg)
    keep[j]   in {0,1}  y: block j keeps its internals until b_j (if allow_keep)
    resident[j] in {0,1}  block j's weights stay in HBM from f_j to b_j (if allow_keep; no
              kept internals needed: the block re-forwards in b_j on them); it ends its segment
    q8[j]     in {0,1}  block j's Adam moments are 8-bit (if allow_q8)
    d2h[i,o], h2d[i,o] in {0,1}  A[i] is offloaded / prefetched in window o (one window each)
    nvw[i,o], nvr[i,o] in [0,1]  fraction of A[i] written / read in window o
              all four only for ords legal for some allowed segment end e (nvw/nvr only with an
              NVMe budget). D2H and H2D are whole so that held[o] below is exact: the runtime
              holds a boundary in HBM until its last D2H byte and from its first H2D byte, which
              a fractional split would under-count (it let plans overflow HBM by part of a
              boundary); NVMe transfers do not touch HBM and may split.
    wdone[i,o] in {0,1}  every NVMe write of A[i] has run by the end of window o; only where a
              read and a write of i may share a window (short-lived boundaries near the end)
    nvb[i,e]  in [0,1]  boundary i is on NVMe with segment end e (>= nvme[i] + seg[i,e] - 1):
              its bounce buffer counts in the DRAM rows over span(i,e) (`staging.bounce_spans`)
    t[o] >= 0                    window time, ms
    slack_hbm[o], slack_host["dram"|"nvme"] >= 0   capacity shortfall, GB: fixed to 0 in the
              step-time model; in the feasibility phase (capacity="min_shortfall") one HBM slack
              column serves every window (the peak's overflow) and the objective is their sum

Window loads (linear; seg-terms sum over segments (s, j+1) ending at b_j):
    comp[f_j] = F[j] + (Fg[j] - F[j]) keep[j];  comp[turn] = head
    comp[b_j] = B[j] + Fg[j] (1 - keep[j]) + sum_s seg[s,j+1] sum_{k=s}^{j-1} F[k]
                + embed * emb[j+1]
    H2D[f_j] = P[j+1];  H2D[turn] = P[L-1] (1 - resident[L-1])
    H2D[b_j] = P[j-1] (1 - resident[j-1]) + sum_s seg[s,j+1] sum_{k=s}^{j-1} P[k] + sum_i A[i] h2d[i,b_j]
    D2H[o] = G[j+1] (o = b_j, j+1 < L) + sum_i A[i] d2h[i,o];  NR[o], NW[o] = sum_i A[i] nvr/nvw
    HOST[o] = PW[o]/host_conv + GD[o]/host_acc, ms, with PW[o] = H2D[o] less its activation
              terms (every weight load, recompute reloads included, is converted on the host)
              and GD[o] = D2H[o] less its activation terms (every drained gradient is added
              into the host accumulator); a term whose rate is 0 is left out

Objective (ms): min  ga * (pre + sum_o t[o] + post + (2L+1) o_w) + const + sum_j U8[j] q8[j]
                                                                   = step_ms of the evaluator
                   (U8[j] = params[j] / 1e9 x q8_update_ms_per_gparam: the 8-bit update's
                   extra time on the optimizer tail, once per step)
                   (o_w = window_overhead_ms, the engine's fixed cost of every window; pre
                   and post carry theirs: a constant in the offset, no variable)
                   + sum_j q8_penalty[j] q8[j]  + tie-breakers       (hard budgets)
           phase 1: min  slack_hbm + slack_host[dram] + slack_host[nvme]    (GB, CAPACITY_MODES)

Constraint families (function that adds them, all in `planner/milp_rows.py`)
    1. path           sum_e seg[0,e] = 1; sum_s seg[s,i] = mat[i] = sum_e seg[i,e];
                      sum_s seg[s,L] = 1                                    add_path
    2. tiers          hbm[i]+dram[i]+nvme[i] = mat[i] (0<i<L);
                      hbm[0]+dram[0]+nvme[0] + sum_e emb[e] = 1; emb[e] <= seg[0,e]   add_tiers
    3. keep           keep[j] <= resident[j] <= mat[j+1]                    add_keep
    4. totals         sum_o d2h = sum_o h2d = dram+nvme; sum_o nvw = sum_o nvr = nvme
                                                                            add_transfer_totals
    5. legality       x[i,o] <= sum_{e: o legal for (i,e)} seg[i,e]         add_transfer_legality
    6. precedence     cum_o nvw <= cum_{o-1} d2h; cum_o nvr <= cum_{o-1} nvw;
                      cum_o h2d <= cum_{o-1} d2h; cum_o h2d <= cum_{o-1} nvr + dram[i]
                      (a chained NVMe transfer never shares its source's window) add_precedence
    6b. reads after writes   nvr[i,o] <= wdone[i,o-1]; wdone[i,o] <= wdone[i,o+1];
                      nvw[i,o+1] + wdone[i,o] <= 1  (no read while a write of i runs)
                                                                            add_reads_after_writes
    7. window time    GPU: t >= comp, H2D/bw_h2d, D2H/bw_d2h, (H2D+D2H)/bw_x, NR/bw_nr, NW/bw_nw,
                           HOST (row time_host: the host works beside the GPU)
                      CPU: t >= comp + H2D/bw_h2d + D2H/bw_d2h + NR/bw_nr + NW/bw_nw + HOST
                                                                            add_window_time
    7b. recompute     GPU: t[b_j] >= X/bw_h2d + sum_s seg[s,j+1] (R[s,j+1] + B[j] + Fg[j]) - Fg[j] keep[j]
                      (recompute waits for its weights behind X on H2D)     add_recompute_order
    8. HBM            held[o] - slack_hbm[o] <= M_hbm  for all o            add_hbm_capacity
    9. DRAM           sum A[i] dram[i] + sum_{o in span(i,e)} Ab[i] nvb[i,e] - sum Q[j] q8[j]
                      - slack <= M_dram for the step and each o;
                      nvb[i,e] >= nvme[i] + seg[i,e] - 1                   add_dram_capacity
   10. NVMe           sum A[i] nvme[i] - slack <= M_nvme                    add_nvme_capacity

held[o] is the contract's holding intervals (exact, since d2h/h2d are binary): hbm i for i <= o <= 2L-i
(A[L] at turn); offloaded i: A[i] sum_{o' >= o} d2h[i,o'] (not yet drained, o >= i) plus
A[i] sum_{o' <= o} h2d[i,o'] (already prefetched, o <= 2L-i); the recompute cache at b_j:
sum_{s <= j < e} seg[s,e] sum_{k=s+1}^{j} A[k] + A[0] sum_{e > j} emb[e]; block j:
I[j] keep[j] + P[j] resident[j] for j <= o <= 2L-j. No big-M anywhere.

Source: docs/execution_model.md (the equations) and docs/design.md ("The plan").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lazytrain.errors import JobFailure
from lazytrain.planner.milp_inputs import Scaled, scale_inputs
from lazytrain.planner.milp_rows import (
    add_dram_capacity, add_hbm_capacity, add_keep, add_nvme_capacity, add_path, add_precedence,
    add_reads_after_writes, add_recompute_order, add_tiers, add_transfer_legality,
    add_transfer_totals, add_window_time,
)
from lazytrain.planner.milp_vars import MilpVars, add_variables
from lazytrain.planner.plan import Bounds, Plan, SolveRecord
from lazytrain.planner.problem import PlanningProblem
from lazytrain.planner.solvers import LinearModel, SolveResult, resolve_backend, solve
from lazytrain.units import GB

SLACK_TOL_GB = 1e-6
"""A capacity slack above this (1 kB) means the budget cannot be met: PlanInfeasibleError."""
CAPACITY_MODES = ("hard", "min_shortfall")
"""`build_milp(capacity=...)`: "hard" budgets (the step-time model; slack columns fixed to 0)
or "min_shortfall" (the feasibility phase: one HBM slack shared by every window plus the DRAM and
NVMe slacks, objective their sum in GB, no time terms). Two phases instead of a slack penalty
in one objective: no penalty weight is large enough for every link speed (at 0.01 GB/s one
transfer costs more than any fixed penalty), so a penalty could trade a shortfall for time."""


SHORTFALL_FIX = {
    "HBM": "raise hardware.hbm_gb or shrink train.micro_batch / data.seq_len",
    # DRAM holds the optimizer states (host_bytes_per_param x params) besides the checkpoints,
    # so the batch is rarely what overflows it; `feasibility.shortfall_fix` drops the options a
    # problem already uses.
    "DRAM": "raise hardware.dram_gb, use train.master_dtype: bf16 (12 B/param instead of 16), "
            "set planner.allow_q8: true (8-bit Adam states), or give checkpoints an NVMe budget "
            "(hardware.nvme_gb)",
    "NVMe": "raise hardware.nvme_gb or shrink train.micro_batch / data.seq_len",
}
"""What to change for each budget a plan overflows, every option (the `; <fix>` of the error
line when the problem is unknown)."""


@dataclass(kw_only=True, frozen=True, slots=True)
class Shortfall:
    """One budget a plan overflows: by how much, where, the need and the budget (bytes)."""

    budget: str
    """"HBM" | "DRAM" | "NVMe"."""
    window: str | None
    """The window of the peak (HBM); None for DRAM/NVMe, which hold for the whole step."""
    short_bytes: float
    need_bytes: float | None = None
    budget_bytes: float | None = None

    def text(self) -> str:
        """`HBM short by 3.20 GB at window b17 (needs 83.20 GB, budget 80.00 GB)`."""
        where = f"at window {self.window}" if self.window else "for the whole step"
        out = f"{self.budget} short by {self.short_bytes / GB:.2f} GB {where}"
        if self.need_bytes is not None and self.budget_bytes is not None:
            out += f" (needs {self.need_bytes / GB:.2f} GB, budget {self.budget_bytes / GB:.2f} GB)"
        return out


class PlanInfeasibleError(JobFailure):
    """A capacity budget cannot be met by any plan the model allows.

    Fields: `budget` ("HBM" | "DRAM" | "NVMe"), `window` (window name, None for DRAM/NVMe which
    hold for the whole step), `shortfall_bytes` (of the first short budget), `shortfalls` (every
    short budget, `Shortfall`), `proven` (False: only the best plan found in the time limit),
    `plan` (the plan that reaches the least shortfall, when known).
    """

    def __init__(self, *, budget: str | None = None, window: str | None = None,
                 shortfall_bytes: float = 0.0, proven: bool = True,
                 shortfalls: tuple[Shortfall, ...] = (), fixes: dict | None = None,
                 plan: Plan | None = None) -> None:
        if not shortfalls:
            shortfalls = (Shortfall(budget=budget, window=window, short_bytes=shortfall_bytes),)
        first = shortfalls[0]
        self.budget, self.window, self.shortfall_bytes = first.budget, first.window, \
            first.short_bytes
        self.shortfalls, self.proven, self.plan = tuple(shortfalls), proven, plan
        fixes = fixes or SHORTFALL_FIX
        why = ("no plan fits" if proven else "the best plan found within the time limit "
               "overflows (a longer planner.time_limit_s may find one that fits)")
        names = " and ".join(dict.fromkeys(s.budget for s in shortfalls))
        super().__init__("; ".join(s.text() for s in shortfalls)
                         + f": {why} the {names} budget{'s' if len(shortfalls) > 1 else ''}; "
                         + "; ".join(fixes[b] for b in dict.fromkeys(s.budget for s in shortfalls)))


# ---------------------------------------------------------------------------------------------
# Model assembly


@dataclass(kw_only=True, slots=True)
class Milp:
    """A built model: the problem, its scaled inputs, the recorded model and the variables."""

    problem: PlanningProblem
    p: Scaled
    model: LinearModel
    v: MilpVars

    def step_ms(self, x: list[float]) -> float:
        """The evaluator's step time of an assignment: ga * sum_o t[o] + `step_const_ms` +
        sum_j U8[j] q8[j] (the 8-bit updates' time on the optimizer tail), ms."""
        times = math.fsum(x[c] for c in self.v.t.values())
        return (self.p.step_const_ms + self.p.grad_accum * times
                + math.fsum(self.p.q8_update[j] * x[c] for j, c in self.v.q8.items()))

    def binaries(self) -> list[int]:
        return [c for c in range(self.model.num_vars) if self.model.var_integer[c]]


def build_milp(problem: PlanningProblem, *, relax: bool = False,
               tie_breakers: bool = True, q8_penalty: bool = True,
               capacity: str = "hard") -> Milp:
    """Build the placement model (families in the module docstring's order).

    Args:
        problem: the planning problem.
        relax: create binaries as continuous [0, 1] (the LP relaxation).
        tie_breakers: add the `milp_inputs.TIE_REL` position-dependent costs (off for bounds
            and brute force).
        q8_penalty: charge 8-bit states in the objective (off for the step-time LP bound).
        capacity: "hard" budgets or the "min_shortfall" feasibility phase (CAPACITY_MODES).

    Raises:
        ValueError: unknown capacity mode.
    """
    if capacity not in CAPACITY_MODES:
        raise ValueError(f"capacity must be one of {CAPACITY_MODES}; got {capacity!r}")
    p = scale_inputs(problem)
    if not tie_breakers or capacity == "min_shortfall":
        p = _replace(p, tie_ms=0.0)
    if not q8_penalty or capacity == "min_shortfall":
        p = _replace(p, q8_penalty=tuple(0.0 for _ in p.q8_penalty))
    m = LinearModel()
    v = add_variables(m, p, relax=relax, capacity=capacity)
    add_path(m, v=v, p=p)
    add_tiers(m, v=v, p=p)
    add_keep(m, v=v, p=p)
    add_transfer_totals(m, v=v, p=p)
    add_transfer_legality(m, v=v, p=p)
    add_precedence(m, v=v, p=p)
    add_reads_after_writes(m, v=v, p=p)
    add_window_time(m, v=v, p=p)
    add_recompute_order(m, v=v, p=p)
    add_hbm_capacity(m, v=v, p=p)
    add_dram_capacity(m, v=v, p=p)
    add_nvme_capacity(m, v=v, p=p)
    return Milp(problem=problem, p=p, model=m, v=v)


def _replace(p: Scaled, **changes) -> Scaled:
    import dataclasses
    return dataclasses.replace(p, **changes)


# ---------------------------------------------------------------------------------------------
# Solve (warm start and extraction: planner/extract.py; feasibility phase: planner/feasibility.py)


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
    import dataclasses

    from lazytrain.planner.extract import extract_plan, start_from_plan
    from lazytrain.planner.feasibility import feasible_plan

    backend = resolve_backend(backend, problem.num_blocks)
    if warm_start is None or warm_start.provenance.get("violations"):
        warm_start = feasible_plan(problem, backend=feasibility_backend(backend),
                                   time_limit_s=time_limit_s, threads=threads, seed=seed,
                                   start=warm_start, node_limit=node_limit)
    milp = build_milp(problem)
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
    from lazytrain.planner.wear import WEAR_TIME_SHARE, least_wear_plan

    reference = solved
    if (not warm_start.provenance.get("violations") and warm_start.predicted is not None
            and warm_start.predicted.step_ms < solved.predicted.step_ms):
        reference = warm_start
    wear = least_wear_plan(
        problem, reference, slack=least_wear_slack, backend=backend,
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
    try:
        import highspy  # noqa: F401
    except ImportError:
        return backend
    return "highs"


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
