"""The placement MILP: one formulation of docs/execution_model.md, solved by SCIP or HiGHS.

Knows the execution model's equations (the same ones `planner/evaluate.py` implements) and
nothing of torch; talks to solvers only through `solvers.LinearModel` / `solvers.solve`.

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
    M_hbm = hbm - fixed_hbm; M_dram = dram - staging - host states (all 16/12 B/param);
    M_nvme, GB;  Q[j] = params[j] * (bpp - bpp_q8) / 1e9 (8-bit saving), GB
    H_d, H_p, H_n          drain / prefetch / NVMe-lead horizons (windows), `plan.legal_ords`
    R[s,e]                 recompute chain of segment (s, e): max_k (P[s..k]/bw_h2d + F[k..e-2]),
                           ms (`chains.recompute_chain_ms`)

Variables (MilpVars; code name = DESIGN symbol)
    seg[s,e]  in {0,1}  x: s and e consecutive segment starts
    mat[i]    in {0,1}  z: boundary i materialized, 0 < i < L
    hbm[i], dram[i], nvme[i] in {0,1}  tier of boundary i < L (none: recompute)
    emb[e]    in [0,1]  boundary 0 is re-embedded for first segment (0, e) (integral given seg)
    keep[j]   in {0,1}  y: block j keeps its internals and weights until b_j (if allow_keep)
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
    t[o] >= 0                    window time, ms
    slack_hbm[o], slack_host["dram"|"nvme"] >= 0   capacity shortfall, GB: fixed to 0 in the
              step-time model; in the feasibility phase (capacity="min_shortfall") one HBM slack
              column serves every window (the peak's overflow) and the objective is their sum

Window loads (linear; seg-terms sum over segments (s, j+1) ending at b_j):
    comp[f_j] = F[j] + (Fg[j] - F[j]) keep[j];  comp[turn] = head
    comp[b_j] = B[j] + Fg[j] (1 - keep[j]) + sum_s seg[s,j+1] sum_{k=s}^{j-1} F[k]
                + embed * emb[j+1]
    H2D[f_j] = P[j+1];  H2D[turn] = P[L-1] (1 - keep[L-1])
    H2D[b_j] = P[j-1] (1 - keep[j-1]) + sum_s seg[s,j+1] sum_{k=s}^{j-1} P[k] + sum_i A[i] h2d[i,b_j]
    D2H[o] = G[j+1] (o = b_j, j+1 < L) + sum_i A[i] d2h[i,o];  NR[o], NW[o] = sum_i A[i] nvr/nvw
    HOST[o] = PW[o]/host_conv + GD[o]/host_acc, ms, with PW[o] = H2D[o] less its activation
              terms (every weight load, recompute reloads included, is converted on the host)
              and GD[o] = D2H[o] less its activation terms (every drained gradient is added
              into the host accumulator); a term whose rate is 0 is left out

Objective (ms): min  ga * (pre + sum_o t[o] + post + (2L+1) o_w) + const
                                                                   = step_ms of the evaluator
                   (o_w = window_overhead_ms, the engine's fixed cost of every window; pre
                   and post carry theirs: a constant in the offset, no variable)
                   + sum_j q8_penalty[j] q8[j]  + tie-breakers       (hard budgets)
           phase 1: min  slack_hbm + slack_host[dram] + slack_host[nvme]    (GB, CAPACITY_MODES)

Constraint families (function that adds them)
    1. path           sum_e seg[0,e] = 1; sum_s seg[s,i] = mat[i] = sum_e seg[i,e];
                      sum_s seg[s,L] = 1                                    add_path
    2. tiers          hbm[i]+dram[i]+nvme[i] = mat[i] (0<i<L);
                      hbm[0]+dram[0]+nvme[0] + sum_e emb[e] = 1; emb[e] <= seg[0,e]   add_tiers
    3. keep           keep[j] <= mat[j+1]                                   add_keep
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
    8. HBM            held[o] + keep terms - slack_hbm[o] <= M_hbm  for all o  add_hbm_capacity
    9. DRAM           sum A[i] dram[i] - sum Q[j] q8[j] - slack <= M_dram  add_dram_capacity
   10. NVMe           sum A[i] nvme[i] - slack <= M_nvme                    add_nvme_capacity

held[o] is the contract's holding intervals (exact, since d2h/h2d are binary): hbm i for i <= o <= 2L-i
(A[L] at turn); offloaded i: A[i] sum_{o' >= o} d2h[i,o'] (not yet drained, o >= i) plus
A[i] sum_{o' <= o} h2d[i,o'] (already prefetched, o <= 2L-i); the recompute cache at b_j:
sum_{s <= j < e} seg[s,e] sum_{k=s+1}^{j} A[k] + A[0] sum_{e > j} emb[e]; keep j:
(I[j] + P[j]) keep[j] for j <= o <= 2L-j. No big-M anywhere.

Source: DESIGN.md section 3; docs/execution_model.md; ../shared/PLANNER_NOTES.md section 6.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lazytrain.errors import JobFailure
from lazytrain.planner.chains import recompute_chain_ms
from lazytrain.planner.plan import (
    Bounds, Plan, SolveRecord, legal_ords, window_name,
)
from lazytrain.planner.problem import PlanningProblem
from lazytrain.planner.solvers import LinearModel, SolveResult, resolve_backend, solve

GB = 1e9
"""Bytes per GB (DESIGN: GB means 1e9 bytes)."""
WHOLE_TRANSFERS = ("d2h", "h2d")
"""Transfer families moved in one window (binary), so the HBM holding intervals are exact."""
BINARY_TOL = 1e-4
"""A binary's solver value must be within this of 0 or 1; extraction rounds at 0.5."""
FRACTION_EPS = 1e-7
"""Transfer fractions below this are dropped at extraction (then each kind is renormalized)."""
SLACK_TOL_GB = 1e-6
"""A capacity slack above this (1 kB) means the budget cannot be met: PlanInfeasibleError."""
CAPACITY_MODES = ("hard", "min_shortfall")
"""`build_milp(capacity=...)`: "hard" budgets (the step-time model; slack columns fixed to 0)
or "min_shortfall" (the feasibility phase: one HBM slack shared by every window plus the DRAM and
NVMe slacks, objective their sum in GB, no time terms). Two phases instead of a slack penalty
in one objective: no penalty weight is large enough for every link speed (at 0.01 GB/s one
transfer costs more than any fixed penalty), so a penalty could trade a shortfall for time."""
TIE_REL = 1e-8
"""Tie-breaker unit as a fraction of the step's compute (sum of F, Fg, B, head): well below any
solver gap (>= 1e-6) and below the test tolerance; the sum over all tie terms stays < 1e-6 of
the step. Tie-breakers: dram costs 1 unit, nvme 2, both times (1 + i/L) (late boundaries stay in
HBM, early ones go furthest); d2h/nvw prefer early windows and h2d/nvr late ones."""
KINDS = {"d2h": "d2h", "h2d": "h2d", "nvw": "nvme_write", "nvr": "nvme_read"}
"""MilpVars transfer family -> Plan transfer kind."""


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


def row_name(family: str, *idx) -> str:
    """`family[idx,...]`, the one naming scheme for rows and variables (e.g. hbm_cap[b17])."""
    return f"{family}[{','.join(str(x) for x in idx)}]"


# ---------------------------------------------------------------------------------------------
# Scaled inputs


@dataclass(kw_only=True, frozen=True, slots=True)
class Scaled:
    """The problem in model units: ms, GB and GB/ms (see the module docstring's legend)."""

    L: int
    F: tuple[float, ...]
    Fg: tuple[float, ...]
    B: tuple[float, ...]
    P: tuple[float, ...]
    G: tuple[float, ...]
    I: tuple[float, ...]  # noqa: E741
    A: tuple[float, ...]
    bw_h2d: float
    bw_d2h: float
    bw_x: float
    bw_nr: float
    bw_nw: float
    host_conv: float
    """Host conversion rate, GB of compute-dtype weights per ms (0: host not modelled)."""
    host_acc: float
    """Host accumulation rate, GB of drained gradients per ms (0: not modelled)."""
    embed: float
    head: float
    overlap: bool
    grad_accum: int
    step_const_ms: float
    """ga * (pre + post + (2L+1) window_overhead_ms) + const_ms, ms (pre and post include
    their own window overhead)."""
    hbm_cap: float
    dram_cap: float
    nvme_cap: float
    q8_saving: tuple[float, ...]
    q8_penalty: tuple[float, ...]
    horizons: dict
    k_max: int
    allow_keep: bool
    allow_q8: bool
    has_nvme: bool
    tie_ms: float
    recompute_chain: dict
    """(s, e) -> R[s,e], ms, for segments with recompute (`chains.recompute_chain_ms`)."""


def scale_inputs(problem: PlanningProblem) -> Scaled:
    """Convert bytes to GB and bytes/s to GB/ms (the only unit conversion of the model)."""
    from lazytrain.planner.evaluate import post_ms, pre_ms  # the evaluator's constants, shared
    p, L = problem, problem.num_blocks
    gb = lambda xs: tuple(x / GB for x in xs)  # noqa: E731
    per_ms = lambda bps: bps / GB / 1e3  # noqa: E731
    pre = pre_ms(p)
    post = post_ms(p)
    states = p.host_bytes_per_param * (sum(p.params_per_block) + p.ends_params)
    compute = sum(p.fwd_ms) + sum(p.fwd_grad_ms) + sum(p.bwd_ms) + p.head_ms
    ref_ms = max(compute, 1e-3)
    return Scaled(
        L=L, F=tuple(p.fwd_ms), Fg=tuple(p.fwd_grad_ms), B=tuple(p.bwd_ms),
        P=gb(p.weight_bytes), G=gb(p.grad_bytes), I=gb(p.internal_bytes), A=gb(p.boundary_bytes),
        bw_h2d=per_ms(p.h2d_bytes_per_s), bw_d2h=per_ms(p.d2h_bytes_per_s),
        bw_x=per_ms(p.duplex_bytes_per_s), bw_nr=per_ms(p.nvme_read_bytes_per_s),
        bw_nw=per_ms(p.nvme_write_bytes_per_s), host_conv=per_ms(p.host_convert_bytes_per_s),
        host_acc=per_ms(p.host_accumulate_bytes_per_s), embed=p.embed_ms, head=p.head_ms,
        overlap=p.copies_overlap_compute, grad_accum=p.grad_accum,
        step_const_ms=p.grad_accum * (pre + post + (2 * L + 1) * p.window_overhead_ms)
        + p.const_ms,
        hbm_cap=(p.hbm_bytes - p.fixed_hbm_bytes) / GB,
        dram_cap=(p.dram_bytes - p.nvme_staging_bytes - states) / GB,
        nvme_cap=p.nvme_bytes / GB,
        q8_saving=tuple(n * (p.host_bytes_per_param - p.host_bytes_per_param_q8) / GB
                        for n in p.params_per_block),
        q8_penalty=tuple(n / 1e9 * p.q8_penalty_ms_per_gparam for n in p.params_per_block),
        horizons={"drain_windows": p.drain_windows, "prefetch_windows": p.prefetch_windows,
                  "nvme_lead_windows": p.nvme_lead_windows},
        k_max=p.k_max, allow_keep=p.allow_keep, allow_q8=p.allow_q8, has_nvme=p.nvme_bytes > 0,
        tie_ms=TIE_REL * ref_ms,
        recompute_chain={(s, e): recompute_chain_ms(p, s, e) for s in range(L)
                         for e in range(s + 2, min(L, s + p.k_max) + 1)})


# ---------------------------------------------------------------------------------------------
# Variables


@dataclass(kw_only=True, slots=True)
class MilpVars:
    """Column indices of every variable family (see the module docstring)."""

    seg: dict[tuple[int, int], int] = field(default_factory=dict)
    mat: dict[int, int] = field(default_factory=dict)
    hbm: dict[int, int] = field(default_factory=dict)
    dram: dict[int, int] = field(default_factory=dict)
    nvme: dict[int, int] = field(default_factory=dict)
    emb: dict[int, int] = field(default_factory=dict)
    keep: dict[int, int] = field(default_factory=dict)
    q8: dict[int, int] = field(default_factory=dict)
    d2h: dict[tuple[int, int], int] = field(default_factory=dict)
    h2d: dict[tuple[int, int], int] = field(default_factory=dict)
    nvw: dict[tuple[int, int], int] = field(default_factory=dict)
    nvr: dict[tuple[int, int], int] = field(default_factory=dict)
    t: dict[int, int] = field(default_factory=dict)
    slack_hbm: dict[int, int] = field(default_factory=dict)
    slack_host: dict[str, int] = field(default_factory=dict)
    wdone: dict[tuple[int, int], int] = field(default_factory=dict)
    legal_ends: dict[tuple[str, int, int], tuple[int, ...]] = field(default_factory=dict)
    """(family, i, o) -> segment ends e for which window o is legal (not a variable)."""

    def transfer(self, family: str) -> dict[tuple[int, int], int]:
        return getattr(self, family)

    def ords(self, family: str, i: int) -> list[int]:
        """Sorted window ords of boundary i's variables in a transfer family."""
        return sorted(o for (b, o) in self.transfer(family) if b == i)


def add_variables(m: LinearModel, p: Scaled, *, relax: bool = False,
                  capacity: str = "hard") -> MilpVars:
    """Create every variable family (only legal transfer windows) with its objective terms.

    `capacity` (CAPACITY_MODES): "hard" fixes the slacks to 0; "min_shortfall" makes one HBM
    slack for all windows and puts only the slacks in the objective (GB).
    """
    L, v, binary = p.L, MilpVars(), not relax
    for s in range(L):
        for e in range(s + 1, min(L, s + p.k_max) + 1):
            v.seg[s, e] = m.add_var(row_name("seg", s, e), ub=1, integer=binary)
    for i in range(1, L):
        v.mat[i] = m.add_var(row_name("mat", i), ub=1, integer=binary)
    tiers = [("hbm", v.hbm, 0.0), ("dram", v.dram, 1.0)] + ([("nvme", v.nvme, 2.0)]
                                                            if p.has_nvme else [])
    for i in range(L):
        for name, fam, tie in tiers:
            fam[i] = m.add_var(row_name(name, i), ub=1, integer=binary,
                               obj=p.tie_ms * tie * (1 + i / L))
    for (s, e) in v.seg:
        if s == 0:
            v.emb[e] = m.add_var(row_name("emb", e), ub=1)
    for j in range(L) if p.allow_keep else ():
        v.keep[j] = m.add_var(row_name("keep", j), ub=1, integer=binary)
    for j in range(L) if p.allow_q8 else ():
        v.q8[j] = m.add_var(row_name("q8", j), ub=1, integer=binary, obj=p.q8_penalty[j])
    families = ("d2h", "h2d", "nvw", "nvr") if p.has_nvme else ("d2h", "h2d")
    for fam in families:
        late = fam in ("h2d", "nvr")
        for i in range(L):
            ends: dict[int, list[int]] = {}
            for e in range(i + 1, min(L, i + p.k_max) + 1):
                for o in legal_ords(KINDS[fam], i, e, L, **p.horizons):
                    ends.setdefault(o, []).append(e)
            whole = binary and fam in WHOLE_TRANSFERS
            for o in sorted(ends):
                pos = (2 * L - o) if late else (o - i)
                v.transfer(fam)[i, o] = m.add_var(row_name(fam, i, window_name(o, L)), ub=1,
                                                  obj=p.tie_ms * pos / (2 * L), integer=whole)
                v.legal_ends[fam, i, o] = tuple(ends[o])
    for i in range(L) if p.has_nvme else ():
        writes, reads = v.ords("nvw", i), v.ords("nvr", i)
        shared = [o for o in reads if writes and o <= writes[-1]]
        # a read at ord <= i is already 0 (family 6: nothing written before i)
        for q in range(max(shared[0] - 1, i), writes[-1]) if shared else ():
            v.wdone[i, q] = m.add_var(row_name("wdone", i, window_name(q, L)), ub=1,
                                      integer=binary)
    shortfall = capacity == "min_shortfall"
    for o in range(2 * L + 1):
        v.t[o] = m.add_var(row_name("t", window_name(o, L)), obj=0.0 if shortfall else p.grad_accum)
    hbm_slack = m.add_var(row_name("slack_hbm", "all"), obj=1.0) if shortfall else None
    for o in range(2 * L + 1):
        v.slack_hbm[o] = hbm_slack if shortfall else m.add_var(
            row_name("slack_hbm", window_name(o, L)), ub=0.0)
    for budget in ("dram", "nvme"):
        v.slack_host[budget] = m.add_var(row_name("slack", budget), obj=1.0 if shortfall else 0.0,
                                         ub=math.inf if shortfall else 0.0)
    m.obj_offset = 0.0 if shortfall else p.step_const_ms
    return v


# ---------------------------------------------------------------------------------------------
# Constraint families


def add_path(m: LinearModel, *, v: MilpVars, p: Scaled) -> None:
    """sum_e seg[0,e] = 1;  sum_s seg[s,i] = mat[i] = sum_e seg[i,e] (0<i<L);  sum_s seg[s,L] = 1.

    The chosen segments form one path 0 -> L through the materialized boundaries (its LP is a
    shortest path, integral on its own). Dimensionless. Source: DESIGN.md section 3 (x[s,e]).
    """
    L = p.L
    m.add_row(row_name("path_out", 0), {v.seg[s, e]: 1 for (s, e) in v.seg if s == 0}, lb=1, ub=1)
    for i in range(1, L):
        into = {v.seg[s, e]: 1.0 for (s, e) in v.seg if e == i}
        out = {v.seg[s, e]: 1.0 for (s, e) in v.seg if s == i}
        m.add_row(row_name("path_in", i), {**into, v.mat[i]: -1.0}, lb=0, ub=0)
        m.add_row(row_name("path_out", i), {**out, v.mat[i]: -1.0}, lb=0, ub=0)
    m.add_row(row_name("path_in", L), {v.seg[s, e]: 1 for (s, e) in v.seg if e == L}, lb=1, ub=1)


def add_tiers(m: LinearModel, *, v: MilpVars, p: Scaled) -> None:
    """hbm[i] + dram[i] + nvme[i] = mat[i];  boundary 0: tiers + sum_e emb[e] = 1, emb <= seg[0,e].

    Every materialized boundary lives in exactly one tier; boundary 0 (always a segment start)
    is stored or re-embedded for its first segment. Dimensionless. Source: DESIGN.md section 3.
    """
    for i in v.hbm:
        coeffs = {fam[i]: 1.0 for fam in (v.hbm, v.dram, v.nvme) if i in fam}
        if i == 0:
            m.add_row(row_name("tier", 0), {**coeffs, **{x: 1.0 for x in v.emb.values()}},
                      lb=1, ub=1)
        else:
            m.add_row(row_name("tier", i), {**coeffs, v.mat[i]: -1.0}, lb=0, ub=0)
    for e, x in v.emb.items():
        m.add_row(row_name("emb_seg", e), {x: 1.0, v.seg[0, e]: -1.0}, ub=0)


def add_keep(m: LinearModel, *, v: MilpVars, p: Scaled) -> None:
    """keep[j] <= mat[j+1]  for j + 1 < L.

    A kept block ends its segment, so it is never recomputed (docs/execution_model.md,
    "Decisions in a Plan"). Dimensionless.
    """
    for j, x in v.keep.items():
        if j + 1 < p.L:
            m.add_row(row_name("keep_end", j), {x: 1.0, v.mat[j + 1]: -1.0}, ub=0)


def add_transfer_totals(m: LinearModel, *, v: MilpVars, p: Scaled) -> None:
    """sum_o d2h[i,o] = sum_o h2d[i,o] = dram[i] + nvme[i];  sum_o nvw = sum_o nvr = nvme[i].

    An offloaded checkpoint leaves HBM and comes back completely; an NVMe one is also written
    and read back completely. Fractions of A[i]. Source: docs/execution_model.md, "Transfers".
    """
    for fam in ("d2h", "h2d", "nvw", "nvr"):
        for i in range(p.L):
            coeffs = {v.transfer(fam)[i, o]: 1.0 for o in v.ords(fam, i)}
            tiers = (v.dram, v.nvme) if fam in ("d2h", "h2d") else (v.nvme,)
            for tier in tiers:
                if i in tier:
                    coeffs[tier[i]] = -1.0
            if len(coeffs) > 0 and (fam in ("d2h", "h2d") or i in v.nvme):
                m.add_row(row_name(f"{fam}_total", i), coeffs, lb=0, ub=0)


def add_transfer_legality(m: LinearModel, *, v: MilpVars, p: Scaled) -> None:
    """x[i,o] <= sum_{e : o in legal_ords(kind, i, e)} seg[i,e]  for x in d2h, h2d, nvw, nvr.

    A transfer may run in window o only if the segment that boundary i starts ends where o is
    legal (reads/prefetches depend on the use window b_{e-1}). Rows are added only where some
    allowed end forbids o (elsewhere the totals bound x). Fractions. Source: plan.legal_ords.
    """
    all_ends = {i: [e for (s, e) in v.seg if s == i] for i in range(p.L)}
    for (fam, i, o), ends in v.legal_ends.items():
        if len(ends) < len(all_ends[i]):
            coeffs = {v.transfer(fam)[i, o]: 1.0, **{v.seg[i, e]: -1.0 for e in ends}}
            m.add_row(row_name(f"{fam}_legal", i, window_name(o, p.L)), coeffs, ub=0)


def add_precedence(m: LinearModel, *, v: MilpVars, p: Scaled) -> None:
    """cum_o nvw <= cum_{o-1} d2h;  cum_o nvr <= cum_{o-1} nvw;  cum_o h2d <= cum_{o-1} d2h;
    cum_o h2d <= cum_{o-1} nvr + dram.

    cum_o x = sum_{o' <= o} x[i,o']. A chained NVMe transfer runs in a later window than the
    part of its source it moves: the runtime starts it only after the source's whole transfer,
    so a same-window pair would not pipeline (docs/execution_model.md, "In-window order"); a
    DRAM boundary's h2d in its d2h's window would adopt the HBM copy and move nothing. The
    dram[i] term switches the NVMe-read rule off for DRAM checkpoints. Rows only at ords where
    the earlier kind may be incomplete (later rows follow from the totals). Fractions.
    Source: docs/execution_model.md, "Transfers and their legal windows" (precedence column).
    """
    rules = [("nvw", "d2h", False, 1), ("nvr", "nvw", False, 1), ("h2d", "d2h", False, 1),
             ("h2d", "nvr", True, 1)]
    for later, earlier, plus_dram, lag in rules:
        for i in range(p.L):
            lo_ords, hi_ords = v.ords(later, i), v.ords(earlier, i)
            if not lo_ords or (plus_dram and i not in v.nvme):
                continue
            last = hi_ords[-1] if hi_ords else -1
            for o in lo_ords:
                if o - lag >= last:
                    break
                coeffs = {v.transfer(later)[i, q]: 1.0 for q in lo_ords if q <= o}
                for q in hi_ords:
                    if q <= o - lag:
                        coeffs[v.transfer(earlier)[i, q]] = -1.0
                if plus_dram:
                    coeffs[v.dram[i]] = -1.0
                m.add_row(row_name(f"{later}_after_{earlier}", i, window_name(o, p.L)), coeffs,
                          ub=0)


def add_reads_after_writes(m: LinearModel, *, v: MilpVars, p: Scaled) -> None:
    """nvr[i,o] <= wdone[i,o-1];  wdone[i,o] <= wdone[i,o+1];  nvw[i,o+1] + wdone[i,o] <= 1.

    The runtime's NVMe read of a boundary waits for every write of it issued so far, so a read
    in a window that also writes part of the boundary waits for that write: reads start only
    after the boundary's last write window. Precedence (family 6) already orders the bytes; this
    keeps the two out of one window where both are legal (`wdone` exists only there).
    Dimensionless. Source: docs/execution_model.md, "In-window order".
    """
    for (i, q), z in sorted(v.wdone.items()):
        if (i, q + 1) in v.wdone:
            m.add_row(row_name("wdone_monotone", i, window_name(q, p.L)),
                      {z: 1.0, v.wdone[i, q + 1]: -1.0}, ub=0)
        if (i, q + 1) in v.nvw:
            m.add_row(row_name("no_write_after_done", i, window_name(q, p.L)),
                      {v.nvw[i, q + 1]: 1.0, z: 1.0}, ub=1)
        if (i, q + 1) in v.nvr:
            m.add_row(row_name("read_after_writes", i, window_name(q + 1, p.L)),
                      {v.nvr[i, q + 1]: 1.0, z: -1.0}, ub=0)


def add_window_time(m: LinearModel, *, v: MilpVars, p: Scaled) -> None:
    """t[o] >= max(comp, H2D/bw_h2d, D2H/bw_d2h, (H2D+D2H)/bw_x, NR/bw_nr, NW/bw_nw, HOST)  (GPU);
    t[o] >= comp + H2D/bw_h2d + D2H/bw_d2h + NR/bw_nr + NW/bw_nw + HOST  (CPU)  for all o,
    HOST[o] = PW[o]/host_conv + GD[o]/host_acc (`window_host`; each term only when its rate is
    modelled, > 0).

    The window epigraph: a window lasts as long as its slowest channel when copies overlap
    compute (the host converts and accumulates beside the GPU: row `time_host`), and the sum of
    all when they contend for the cores (the host work runs on them too). ms (loads in GB / GB
    per ms). Source: docs/execution_model.md, "Window time", "Host work"; DESIGN.md section 3.
    """
    for o in range(2 * p.L + 1):
        comp, h2d, d2h, nr, nw = window_loads(v, p, o)
        host = window_host(v, p, o)
        if p.overlap:
            terms = [(comp, 1.0), (h2d, 1 / p.bw_h2d), (d2h, 1 / p.bw_d2h),
                     (_lin_sum(h2d, d2h), 1 / p.bw_x), (nr, 1 / p.bw_nr), (nw, 1 / p.bw_nw),
                     (host, 1.0)]
            names = ("comp", "h2d", "d2h", "duplex", "nvr", "nvw", "host")
        else:
            terms = [(_lin_sum(comp, _lin_scale(h2d, 1 / p.bw_h2d), _lin_scale(d2h, 1 / p.bw_d2h),
                               _lin_scale(nr, 1 / p.bw_nr), _lin_scale(nw, 1 / p.bw_nw), host),
                      1.0)]
            names = ("sum",)
        for name, (lin, k) in zip(names, terms):
            coeffs, const = lin
            if not coeffs and const == 0.0:
                continue
            row = {v.t[o]: 1.0, **{x: -c * k for x, c in coeffs.items()}}
            m.add_row(row_name(f"time_{name}", window_name(o, p.L)), row, lb=const * k)


def add_recompute_order(m: LinearModel, *, v: MilpVars, p: Scaled) -> None:
    """t[b_j] >= X[b_j]/bw_h2d + sum_s seg[s,j+1] (R[s,j+1] + B[j] + Fg[j]) - Fg[j] keep[j]
    (GPU), X[b_j] = sum_i A[i] h2d[i,b_j] + P[j-1] (1 - keep[j-1]),
    R[s,e] = max_{k=s..e-2} (sum_{q=s}^{k} P[q]/bw_h2d + sum_{q=k}^{e-2} F[q])  for e - s >= 2.

    A segment's recompute forward of block k waits for its weights, which queue on the H2D
    stream behind the window's activation prefetches and the next block's weights
    (`chains.recompute_chain_ms`). At most one segment ends at j + 1, so the sum picks its
    term; without a recompute segment the row is implied by the H2D row (t >= X/bw_h2d), and
    with keep[j] the re-forward Fg[j] is not run. No big-M. ms.
    Source: docs/execution_model.md, "In-window order".
    """
    if not p.overlap:
        return
    L = p.L
    for j in range(1, L):
        o = 2 * L - j
        segs = {v.seg[s, e]: r + p.B[j] + p.Fg[j] for (s, e), r in p.recompute_chain.items()
                if e == j + 1}
        if not segs:
            continue
        const = p.P[j - 1] / p.bw_h2d
        row = {v.t[o]: 1.0, **{x: -r for x, r in segs.items()}}
        if j in v.keep:
            row[v.keep[j]] = p.Fg[j]
        if j - 1 in v.keep:
            row[v.keep[j - 1]] = -p.P[j - 1] / p.bw_h2d
        for (i, q), x in v.h2d.items():
            if q == o:
                row[x] = -p.A[i] / p.bw_h2d
        m.add_row(row_name("recompute_order", window_name(o, L)), row, lb=const)


def add_hbm_capacity(m: LinearModel, *, v: MilpVars, p: Scaled) -> None:
    """held[o] + sum_{j <= o <= 2L-j} (I[j] + P[j]) keep[j] - slack_hbm[o] <= M_hbm  for all o.

    Checkpoint-store bytes (the contract's holding intervals; exact because D2H and H2D are
    whole, see the module docstring) plus kept internals and resident weights must fit beside the fixed
    working set in every window. GB. Source: docs/execution_model.md, "HBM capacity".
    """
    for o in range(2 * p.L + 1):
        coeffs, const = hbm_held(v, p, o)
        coeffs[v.slack_hbm[o]] = -1.0
        m.add_row(row_name("hbm_cap", window_name(o, p.L)), coeffs, ub=p.hbm_cap - const)


def add_dram_capacity(m: LinearModel, *, v: MilpVars, p: Scaled) -> None:
    """sum_i A[i] dram[i] - sum_j Q[j] q8[j] - slack_host[dram] <= M_dram.

    DRAM checkpoints fit beside the host optimizer states (8-bit moments free Q[j]) and the NVMe
    staging pool. GB. Source: docs/execution_model.md, "DRAM and NVMe capacity".
    """
    coeffs = {x: p.A[i] for i, x in v.dram.items()}
    coeffs.update({x: -p.q8_saving[j] for j, x in v.q8.items()})
    coeffs[v.slack_host["dram"]] = -1.0
    m.add_row(row_name("dram_cap", "step"), coeffs, ub=p.dram_cap)


def add_nvme_capacity(m: LinearModel, *, v: MilpVars, p: Scaled) -> None:
    """sum_i A[i] nvme[i] - slack_host[nvme] <= M_nvme.

    NVMe checkpoints fit the scratch budget. GB. Source: docs/execution_model.md.
    """
    coeffs = {x: p.A[i] for i, x in v.nvme.items()}
    coeffs[v.slack_host["nvme"]] = -1.0
    m.add_row(row_name("nvme_cap", "step"), coeffs, ub=p.nvme_cap)


# ---------------------------------------------------------------------------------------------
# Linear expressions of one window: ({column: coef}, constant)

Lin = tuple[dict[int, float], float]


def _lin_sum(*lins: Lin) -> Lin:
    coeffs: dict[int, float] = {}
    for c, _ in lins:
        for x, a in c.items():
            coeffs[x] = coeffs.get(x, 0.0) + a
    return coeffs, sum(k for _, k in lins)


def _lin_scale(lin: Lin, k: float) -> Lin:
    return {x: a * k for x, a in lin[0].items()}, lin[1] * k


def window_fixed_loads(v: MilpVars, p: Scaled, o: int) -> tuple[Lin, Lin, Lin]:
    """(compute ms, weight H2D GB, gradient D2H GB) of window o: the window loads before the
    plan's activation transfers (module docstring)."""
    L = p.L
    comp: dict[int, float] = {}
    h2d: dict[int, float] = {}
    d2h: dict[int, float] = {}
    if o < L:
        j = o
        c0, h0, d0 = p.F[j], (p.P[j + 1] if j + 1 < L else 0.0), 0.0
        if j in v.keep:
            comp[v.keep[j]] = p.Fg[j] - p.F[j]
    elif o == L:
        c0, h0, d0 = p.head, p.P[L - 1], 0.0
        if L - 1 in v.keep:
            h2d[v.keep[L - 1]] = -p.P[L - 1]
    else:
        j = 2 * L - o
        c0, h0 = p.B[j] + p.Fg[j], (p.P[j - 1] if j >= 1 else 0.0)
        d0 = p.G[j + 1] if j + 1 < L else 0.0
        if j in v.keep:
            comp[v.keep[j]] = -p.Fg[j]
        if j >= 1 and j - 1 in v.keep:
            h2d[v.keep[j - 1]] = -p.P[j - 1]
        for (s, e), x in v.seg.items():
            if e == j + 1 and e - s >= 2:
                comp[x] = sum(p.F[s:j])
                h2d[x] = sum(p.P[s:j])
        if j + 1 in v.emb and p.embed:
            comp[v.emb[j + 1]] = p.embed
    return (comp, c0), (h2d, h0), (d2h, d0)


def window_host(v: MilpVars, p: Scaled, o: int) -> Lin:
    """HOST[o] = PW[o]/host_conv + GD[o]/host_acc, ms: the weight bytes the window loads (all
    of them are converted into staging) and the gradient bytes it drains (all of them are
    added into the host accumulator); a rate of 0 is not modelled and adds nothing."""
    _, (pw, pw0), (gd, gd0) = window_fixed_loads(v, p, o)
    parts = []
    if p.host_conv > 0:
        parts.append(_lin_scale((pw, pw0), 1 / p.host_conv))
    if p.host_acc > 0:
        parts.append(_lin_scale((gd, gd0), 1 / p.host_acc))
    return _lin_sum(*parts) if parts else ({}, 0.0)


def window_loads(v: MilpVars, p: Scaled, o: int) -> tuple[Lin, Lin, Lin, Lin, Lin]:
    """(compute ms, H2D GB, D2H GB, NVMe read GB, NVMe write GB) of window o (module docstring)."""
    (comp, c0), (h2d, h0), (d2h, d0) = window_fixed_loads(v, p, o)
    h2d, d2h = dict(h2d), dict(d2h)
    for (i, q), x in v.h2d.items():
        if q == o:
            h2d[x] = h2d.get(x, 0.0) + p.A[i]
    for (i, q), x in v.d2h.items():
        if q == o:
            d2h[x] = p.A[i]
    nr = {x: p.A[i] for (i, q), x in v.nvr.items() if q == o}
    nw = {x: p.A[i] for (i, q), x in v.nvw.items() if q == o}
    return (comp, c0), (h2d, h0), (d2h, d0), (nr, 0.0), (nw, 0.0)


def hbm_held(v: MilpVars, p: Scaled, o: int) -> Lin:
    """Checkpoint-store bytes plus keep terms held in window o, GB (module docstring, held[o])."""
    L, A = p.L, p.A
    coeffs: dict[int, float] = {}
    const = A[L] if o == L else 0.0

    def add(x: int, a: float) -> None:
        if a:
            coeffs[x] = coeffs.get(x, 0.0) + a

    for i, x in v.hbm.items():
        if i <= o <= 2 * L - i:
            add(x, A[i])
    for (i, q), x in v.d2h.items():
        if i <= o <= q:
            add(x, A[i])
    for (i, q), x in v.h2d.items():
        if q <= o <= 2 * L - i:
            add(x, A[i])
    if o > L:
        j = 2 * L - o
        for (s, e), x in v.seg.items():
            if s < j < e:
                add(x, sum(A[s + 1:j + 1]))
        for e, x in v.emb.items():
            if e > j:
                add(x, A[0])
    for j, x in v.keep.items():
        if j <= o <= 2 * L - j:
            add(x, p.I[j] + p.P[j])
    return coeffs, const


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
        """The evaluator's step time of an assignment: ga * sum_o t[o] + `step_const_ms`."""
        return self.p.step_const_ms + self.p.grad_accum * math.fsum(x[c] for c in self.v.t.values())

    def binaries(self) -> list[int]:
        return [c for c in range(self.model.num_vars) if self.model.var_integer[c]]


def build_milp(problem: PlanningProblem, *, relax: bool = False,
               tie_breakers: bool = True, q8_penalty: bool = True,
               capacity: str = "hard") -> Milp:
    """Build the placement model (families in the module docstring's order).

    Args:
        problem: the planning problem.
        relax: create binaries as continuous [0, 1] (the LP relaxation).
        tie_breakers: add the TIE_REL position-dependent costs (off for bounds and brute force).
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
               warm_start: Plan | None = None, bounds: Bounds | None = None) -> Plan:
    """Solve the placement MILP and return its plan (the incumbent on a time-out).

    Two phases: when `warm_start` is missing or breaks a budget, the feasibility phase
    (`feasibility.feasible_plan`) first finds a plan that fits, or raises naming every short
    budget with its least shortfall; then the step-time model with hard budgets starts from it.

    Args:
        problem: the planning problem.
        backend: "auto" (HiGHS up to 64 blocks, SCIP above; see solvers.resolve_backend),
            "highs" or "scip".
        time_limit_s: solver wall-clock limit of each phase, s (model building not counted).
        gap: relative gap at which the search stops.
        threads, seed: solver threads and random seed (defaults: deterministic).
        warm_start: a plan to start from (usually `heuristics.heuristic_plan`); when it fits the
            budgets it is also the answer if the solver finds no incumbent in time.
        bounds: filled into the plan's `bounds` as given; its `lp_step_ms` also bounds the gap
            (`gap_against_best_bound`).

    Returns:
        Plan whose `solver` record holds backend, status ("optimal", "time_limit", or
        "no_incumbent" when the warm start is returned), solve_s, gap (objective vs. the best
        bound known: the solver's dual bound or the LP bound), num_vars, num_rows.

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
                                   start=warm_start)
    milp = build_milp(problem)
    start = start_from_plan(milp, warm_start)
    res = solve(milp.model, backend=backend, time_limit_s=time_limit_s, gap=gap,
                threads=threads, seed=seed, start=start)
    lp = bounds.lp_step_ms if bounds is not None else None
    record = solve_record(milp, res, lp_bound_ms=lp)
    if res.values is None:
        if res.status == "infeasible":
            raise RuntimeError(f"{backend} reports the placement model infeasible although the "
                               f"feasibility phase found a plan: a model bug (rows "
                               f"{milp.model.num_rows})")
        return dataclasses.replace(warm_start, solver=dataclasses.replace(
            record, status="no_incumbent", gap=gap_against_best_bound(
                warm_start.predicted.step_ms, None, lp)), bounds=bounds or warm_start.bounds)
    return extract_plan(milp, res.values, solver=record, bounds=bounds)


def feasibility_backend(backend: str) -> str:
    """The solver of the feasibility phase: HiGHS when installed, else `backend`. Measured on
    the NVMe-heavy 128-block benchmark (benchmarks/planner.py): HiGHS proves a fitting plan
    in 0.9 s where SCIP needs 27 s, and SCIP ran out of a 30 s limit on 2 busy cores."""
    try:
        import highspy  # noqa: F401
    except ImportError:
        return backend
    return "highs"


def gap_against_best_bound(objective_ms: float | None, dual_bound_ms: float | None,
                           lp_bound_ms: float | None) -> float | None:
    """(objective - best bound) / best bound with best bound = max(dual bound, LP bound), >= 0.

    A solver stopped before its first dual bound (a node limit of 1, a very short time limit)
    reports none or a trivial one; the LP relaxation bound is valid for every plan, so the gap is
    never worse than against it. None when neither bound is known (or not positive).
    """
    known = [b for b in (dual_bound_ms, lp_bound_ms) if b is not None and math.isfinite(b)
             and b > 0]
    if objective_ms is None or not known:
        return None
    best = max(known)
    return max(0.0, (objective_ms - best) / best)


def solve_record(milp: Milp, res: SolveResult, *, lp_bound_ms: float | None = None
                 ) -> SolveRecord:
    """The Plan JSON `solver` object of one solve (gap against the best bound known)."""
    return SolveRecord(backend=res.backend, status=res.status, solve_s=res.solve_s,
                       gap=gap_against_best_bound(res.objective, res.dual_bound, lp_bound_ms),
                       num_vars=milp.model.num_vars, num_rows=milp.model.num_rows)
