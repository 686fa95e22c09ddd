"""The placement MILP: one formulation of docs/execution_model.md, solved by SCIP or HiGHS.

Knows the execution model's equations (the same ones `planner/evaluate.py` implements) and
nothing of torch; talks to solvers only through `solvers.LinearModel` / `solvers.solve`.

This module owns the formulation (this docstring) and `build_milp` (its table of contents).
The parts live by concern beside it:
    planner/milp_inputs.py   `Scaled`, `scale_inputs`: the parameters below, in model units
    planner/milp_vars.py     `MilpVars`, `add_variables`, `row_name`: the variable families
    planner/milp_loads.py    the window loads and held[o] as linear expressions
    planner/milp_rows.py     the constraint families 1-10, one `add_*` function each
    planner/milp_paths.py    family 11, the per-block weight paths (free paths only)
    planner/milp_levels.py   family 12, the save levels L1/L2 and their tiers and transfers
    planner/milp_solve.py    the solve entry `solve_milp` (its phases, in order)
    planner/extract.py       warm starts (`start_from_plan`) and plans from solutions
    planner/feasibility.py   the feasibility phase (`capacity="min_shortfall"`)
    planner/infeasible.py    the capacity errors (`PlanInfeasibleError`, `Shortfall`)
    planner/wear.py          the least-wear phase after the step-time solve (`least_wear_slack`)
    planner/gaps.py          a plan's gap against the best bound, the solve's `SolveRecord`

Index legend
    j      block 0..L-1 (maps boundary j to boundary j+1)
    i, k   boundary 0..L (A[L] always hbm; boundary 0 "recompute" = re-embedded in backward)
    o, w   window ord 0..2L: f_j -> j, turn -> L, b_j -> 2L - j (names f{j}, turn, b{j})
    s, e   segment ends: consecutive segment starts, 0 <= s < e <= L, e - s <= K
    use(e) = 2L - e + 1, the ord of b_{e-1}, where segment (s, e)'s start is first needed

Parameters (units inside the model: ms and GB; converted once in `scale_inputs`)
    F[j], Fg[j], B[j]      forward, forward with autograd, backward, ms
    Fr[j]                  the truncated re-forward before block j's backward, ms
    P[j], G[j], I[j], A[i] weights, gradients, internals, boundary bytes, GB
    bw_h2d, bw_d2h, bw_x, bw_nr, bw_nw   bandwidths, GB/ms (bw_x: H2D + D2H duplex cap)
    host_conv, host_acc    host conversion / accumulation rates, GB/ms (0: not modelled)
    embed, head            embedding (also re-embed) and head compute in turn, ms
    M_hbm = hbm - fixed_hbm; M_dram = dram - staging pools - host states (all 16/12 B/param;
    the pools less the NVMe bounce buffers, counted per window: Ab[i] = align_up(A[i]), GB);
    M_nvme, GB;  Q[j] = params[j] * (bpp - bpp_q8) / 1e9 (8-bit saving), GB
    U8[j]                  the 8-bit update's extra time of block j, ms per step
    H_d, H_p, H_n          drain / prefetch / NVMe-lead horizons (windows), `windows.legal_ords`
    R[s,e]                 recompute chain of segment (s, e): max_k (P[s..k]/bw_h2d + F[k..e-2]),
                           ms (`chains.recompute_chain_ms`)
    S[j] = (S1[j], S2[j])  block j's saved internals at L1 / L2, GB;  Fr1[j] its L1 re-forward, ms

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
    lvl[j,l,t] in {0,1}  block j saves at level l in {1,2} in tier t in {hbm, dram} (only when
              the problem offers levels; none of them: L0)
    id2h[j,l,o], ih2d[j,l,o] in {0,1}  a dram-tier block's internals leave HBM / come back in
              window o (one window each, legal ords `windows.internal_legal_ords`)
    t[o] >= 0                    window time, ms
    slack_hbm[o], slack_host["dram"|"nvme"] >= 0   capacity shortfall, GB: fixed to 0 in the
              step-time model; in the feasibility phase (capacity="min_shortfall") one HBM slack
              column serves every window (the peak's overflow) and the objective is their sum

Window loads (linear; seg-terms sum over segments (s, j+1) ending at b_j):
    comp[f_j] = F[j] + (Fg[j] - F[j]) keep[j];  comp[turn] = head
    comp[b_j] = B[j] + Fr[j] (1 - keep[j]) + sum_s seg[s,j+1] sum_{k=s}^{j-1} F[k]
                + embed * emb[j+1]
                (save levels: f_j + (Fg-F)(x_1 + x_2), b_j - (Fr-Fr1) x_1 - Fr x_2, and the
                internals' bytes in H2D/D2H: `planner/milp_levels.py`)
    H2D[f_j] = P[j+1];  H2D[turn] = P[L-1] (1 - resident[L-1])
    H2D[b_j] = P[j-1] (1 - resident[j-1]) + sum_s seg[s,j+1] sum_{k=s}^{j-1} P[k] + sum_i A[i] h2d[i,b_j]
    D2H[o] = G[j+1] (o = b_j, j+1 < L) + sum_i A[i] d2h[i,o];  NR[o], NW[o] = sum_i A[i] nvr/nvw
    HOST[o] = PW[o]/host_conv + GD[o]/host_acc, ms, with PW[o] = H2D[o] less its activation
              terms (every weight load, recompute reloads included, is converted on the host)
              and GD[o] = D2H[o] less its activation terms (every drained gradient is added
              into the host accumulator); a term whose rate is 0 is left out

Objective (ms): min  ga * (sum_o t[o] + (2L+1) o_w) + ends + const + sum_j U8[j] q8[j]
                                                                   = step_ms of the evaluator
                   (ends = `pre`/`post` of every micro-batch, `window_time.ends_step_ms`;
                   U8[j] = params[j] / 1e9 x q8_update_ms_per_gparam: the 8-bit update's
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
    7b. recompute     GPU: t[b_j] >= X/bw_h2d + sum_s seg[s,j+1] (R[s,j+1] + B[j] + Fr[j])
                                        - Fr[j] keep[j]
                      (recompute waits for its weights behind X on H2D)     add_recompute_order
    8. HBM            held[o] - slack_hbm[o] <= M_hbm  for all o            add_hbm_capacity
    9. DRAM           sum A[i] dram[i] + sum_{o in span(i,e)} Ab[i] nvb[i,e] - sum Q[j] q8[j]
                      - slack <= M_dram for the step and each o;
                      nvb[i,e] >= nvme[i] + seg[i,e] - 1                   add_dram_capacity
   10. NVMe           sum A[i] nvme[i] - slack <= M_nvme                    add_nvme_capacity
   11. weight paths   (build_milp(free_paths=True) only) one path per block, its H2D and host
                      bytes in every load above, its HBM and DRAM in rows 8-9, the recompute
                      chain of 7b as columns: `planner/milp_paths.py`        add_path_rows
   12. save levels    one level per block (or keep), whole d2h/h2d of dram-tier internals with
                      the h2d strictly later; their bytes and compute in 7/7b, HBM in 8, DRAM
                      per window in 9: `planner/milp_levels.py`             add_level_rows
   12b. level cuts    GPU: t[o] >= c[o] + sum_y ((X0[o] + a_y)/bw - c[o])+ y over the window's
                      whole transfers y (valid; tightens the LP: a whole transfer cannot hide
                      in a window's idle link a few percent at a time)
                                                                            add_level_transfer_cuts

held[o] is the contract's holding intervals (exact, since d2h/h2d are binary): hbm i for i <= o <= 2L-i
(A[L] at turn); offloaded i: A[i] sum_{o' >= o} d2h[i,o'] (not yet drained, o >= i) plus
A[i] sum_{o' <= o} h2d[i,o'] (already prefetched, o <= 2L-i); the recompute cache at b_j:
sum_{s <= j < e} seg[s,e] sum_{k=s+1}^{j} A[k] + A[0] sum_{e > j} emb[e]; block j:
I[j] keep[j] + P[j] resident[j] for j <= o <= 2L-j; saved internals S_l[j] lvl[j,l,hbm] for
j <= o <= 2L-j and, in the dram tier, until their d2h and from their h2d. No big-M anywhere.

Source: docs/execution_model.md (the equations) and docs/design.md ("The plan").
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from lazytrain.planner.milp_inputs import Scaled, scale_inputs
from lazytrain.planner.milp_levels import add_level_columns, add_level_rows
from lazytrain.planner.milp_paths import add_path_columns, add_path_rows, free_path_loads
from lazytrain.planner.milp_rows import (
    add_dram_capacity, add_hbm_capacity, add_keep, add_level_transfer_cuts, add_nvme_capacity,
    add_path, add_precedence,
    add_reads_after_writes, add_recompute_order, add_tiers, add_transfer_legality,
    add_transfer_totals, add_window_time,
)
from lazytrain.planner.milp_vars import MilpVars, add_variables
from lazytrain.planner.problem import PlanningProblem
from lazytrain.planner.solvers import LinearModel
from lazytrain.planner.weight_paths import with_weight_paths

CAPACITY_MODES = ("hard", "min_shortfall")
"""`build_milp(capacity=...)`: "hard" budgets (the step-time model; slack columns fixed to 0)
or "min_shortfall" (the feasibility phase: one HBM slack shared by every window plus the DRAM and
NVMe slacks, objective their sum in GB, no time terms). Two phases instead of a slack penalty
in one objective: no penalty weight is large enough for every link speed (at 0.01 GB/s one
transfer costs more than any fixed penalty), so a penalty could trade a shortfall for time."""


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
        sum_j U8[j] q8[j] (the 8-bit updates' time on the optimizer tail) + sum_w
        (C_w - C_base) path[0,w] (block 0's path in the ends, free paths only:
        `milp_paths.free_path_loads`), ms."""
        times = math.fsum(x[c] for c in self.v.t.values())
        ends = math.fsum(self.p.path_loads[w][2] * x[c]
                         for (j, w), c in self.v.path.items() if j == 0)
        return (self.p.step_const_ms + ends + self.p.grad_accum * times
                + math.fsum(self.p.q8_update[j] * x[c] for j, c in self.v.q8.items()))

    def binaries(self) -> list[int]:
        return [c for c in range(self.model.num_vars) if self.model.var_integer[c]]


def build_milp(problem: PlanningProblem, *, relax: bool = False,
               tie_breakers: bool = True, q8_penalty: bool = True,
               capacity: str = "hard", free_paths: bool = False) -> Milp:
    """Build the placement model (families in the module docstring's order).

    Args:
        problem: the planning problem.
        relax: create binaries as continuous [0, 1] (the LP relaxation).
        tie_breakers: add the `milp_inputs.TIE_REL` position-dependent costs (off for bounds
            and brute force).
        q8_penalty: charge 8-bit states in the objective (off for the step-time LP bound).
        capacity: "hard" budgets or the "min_shortfall" feasibility phase (CAPACITY_MODES).
        free_paths: the model chooses each block's weight path (family 11,
            `planner/milp_paths.py`) on the problem with every path host_convert; with masters
            in the compute dtype every block is pinned in place. False: `problem`'s paths.

    Raises:
        ValueError: unknown capacity mode.
    """
    if capacity not in CAPACITY_MODES:
        raise ValueError(f"capacity must be one of {CAPACITY_MODES}; got {capacity!r}")
    if free_paths:
        problem = with_weight_paths(problem, () if problem.master_bytes_ratio != 1
                                    else ("pinned_copy",) * problem.num_blocks)
    p = scale_inputs(problem)
    if free_paths:
        p = _replace(p, path_loads=free_path_loads(problem))
    if not tie_breakers or capacity == "min_shortfall":
        p = _replace(p, tie_ms=0.0)
    if not q8_penalty or capacity == "min_shortfall":
        p = _replace(p, q8_penalty=tuple(0.0 for _ in p.q8_penalty))
    m = LinearModel()
    v = add_variables(m, p, relax=relax, capacity=capacity)
    add_path_columns(m, v, p, relax=relax, shortfall=capacity == "min_shortfall")
    add_level_columns(m, v, p, relax=relax)
    add_path(m, v=v, p=p)
    add_tiers(m, v=v, p=p)
    add_keep(m, v=v, p=p)
    add_level_rows(m, v=v, p=p)
    add_transfer_totals(m, v=v, p=p)
    add_transfer_legality(m, v=v, p=p)
    add_precedence(m, v=v, p=p)
    add_reads_after_writes(m, v=v, p=p)
    add_window_time(m, v=v, p=p)
    add_recompute_order(m, v=v, p=p)
    add_level_transfer_cuts(m, v=v, p=p)
    add_hbm_capacity(m, v=v, p=p)
    add_dram_capacity(m, v=v, p=p)
    add_nvme_capacity(m, v=v, p=p)
    add_path_rows(m, v=v, p=p)
    return Milp(problem=problem, p=p, model=m, v=v)


def _replace(p: Scaled, **changes) -> Scaled:
    return dataclasses.replace(p, **changes)
