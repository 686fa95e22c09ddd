"""The constraint families of the placement MILP, one function each.

Owns `add_path` .. `add_nvme_capacity`, numbered 1 to 10 in the formulation of
`planner/milp.py` (whose `build_milp` calls them in that order). Each docstring's first line is
its equation; rows are named `family[idx]` through `milp_vars.row_name`. A family adds rows
only, on the columns of `milp_vars.MilpVars` and the window loads of `planner/milp_loads.py`.
No solver, no torch.
"""

from __future__ import annotations

from lazytrain.planner.duplex import duplex_pieces, effective_cap
from lazytrain.planner.milp_inputs import Scaled
from lazytrain.planner.milp_levels import level_dram_held, level_order_terms
from lazytrain.planner.milp_loads import (
    reload_unless_resident, hbm_held, lin_scale, lin_sum, window_host, window_loads,
)
from lazytrain.planner.milp_paths import pinned_copies_gb
from lazytrain.planner.milp_vars import MilpVars, row_name
from lazytrain.planner.windows import window_name
from lazytrain.planner.solvers import LinearModel
from lazytrain.planner.staging import bounce_spans

def add_path(m: LinearModel, *, v: MilpVars, p: Scaled) -> None:
    """sum_e seg[0,e] = 1;  sum_s seg[s,i] = mat[i] = sum_e seg[i,e] (0<i<L);  sum_s seg[s,L] = 1.

    The chosen segments form one path 0 -> L through the materialized boundaries (its LP is a
    shortest path, integral on its own). Dimensionless. Source: docs/design.md, "The plan" (segments).
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
    is stored or re-embedded for its first segment. Dimensionless. Source: docs/design.md.
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
    """keep[j] <= resident[j]  for all j;  resident[j] <= mat[j+1]  for j + 1 < L.

    A kept block's graph holds its device weights, so they are resident; resident weights need
    no kept graph (the block re-forwards in b_j on the weights it held since f_j). A resident
    (so also a kept) block ends its segment, so it is never recomputed: the runtime would
    recompute a resident block on its held weights, which the evaluator charges as a reload
    (R[s,e] is one constant per segment), so the model offers residency only where the two
    agree. docs/execution_model.md, "Decisions in a Plan". Dimensionless.
    """
    for j, x in v.keep.items():
        m.add_row(row_name("keep_resident", j), {x: 1.0, v.resident[j]: -1.0}, ub=0)
    for j, x in v.resident.items():
        if j + 1 < p.L:
            m.add_row(row_name("resident_end", j), {x: 1.0, v.mat[j + 1]: -1.0}, ub=0)


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
    allowed end forbids o (elsewhere the totals bound x). Fractions. Source: windows.legal_ords.
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
    """t[o] >= max(comp, H2D/bw_h2d, D2H/bw_d2h, DUPLEX, NR/bw_nr, NW/bw_nw, HOST)  (GPU);
    t[o] >= comp + H2D/bw_h2d + D2H/bw_d2h + NR/bw_nr + NW/bw_nw + HOST  (CPU)  for all o,
    DUPLEX = max((H2D+D2H)/X, max_k (a_k H2D + b_k D2H)) (`duplex.duplex_pieces`: both
    directions sharing the cap X = `duplex.effective_cap` max-min fairly; no piece where the cap
    does not bind, and the first term, always a lower bound, is then implied), HOST[o] =
    PW[o]/host_conv + GD[o]/host_acc (`window_host`; each term only when its rate is modelled,
    > 0).

    The window epigraph: a window lasts as long as its slowest channel when copies overlap
    compute (the host converts and accumulates beside the GPU: row `time_host`), and the sum of
    all when they contend for the cores (the host work runs on them too). The duplex time is
    convex in the two loads, so one row per piece (`time_duplex{k}`) is exact; the row
    `time_duplex` adds nothing to it but helps the LP. ms (loads in GB / GB per ms). Source:
    docs/execution_model.md, "Window time", "Duplex sharing", "Host work".
    """
    for o in range(2 * p.L + 1):
        comp, h2d, d2h, nr, nw = window_loads(v, p, o)
        host = window_host(v, p, o)
        if p.overlap:
            shared = [lin_sum(lin_scale(h2d, a), lin_scale(d2h, b))
                      for a, b in duplex_pieces(p.bw_h2d, p.bw_d2h, p.bw_x)]
            cap = effective_cap(p.bw_h2d, p.bw_d2h, p.bw_x)
            terms = [(comp, 1.0), (h2d, 1 / p.bw_h2d), (d2h, 1 / p.bw_d2h),
                     (lin_sum(h2d, d2h), 1 / cap), *((lin, 1.0) for lin in shared),
                     (nr, 1 / p.bw_nr), (nw, 1 / p.bw_nw), (host, 1.0)]
            names = ("comp", "h2d", "d2h", "duplex",
                     *(f"duplex{k}" for k in range(len(shared))), "nvr", "nvw", "host")
        else:
            terms = [(lin_sum(comp, lin_scale(h2d, 1 / p.bw_h2d), lin_scale(d2h, 1 / p.bw_d2h),
                               lin_scale(nr, 1 / p.bw_nr), lin_scale(nw, 1 / p.bw_nw), host),
                      1.0)]
            names = ("sum",)
        for name, (lin, k) in zip(names, terms):
            coeffs, const = lin
            if not coeffs and const == 0.0:
                continue
            row = {v.t[o]: 1.0, **{x: -c * k for x, c in coeffs.items()}}
            m.add_row(row_name(f"time_{name}", window_name(o, p.L)), row, lb=const * k)


def add_level_transfer_cuts(m: LinearModel, *, v: MilpVars, p: Scaled) -> None:
    """t[o] >= c[o] + sum_y ((X0[o] + a_y) / bw - c[o])+ y  for o, per direction (GPU, with
    save levels): y the window's whole transfers (D2H: d2h[i,o], id2h[j,l,o]; H2D: h2d[i,o],
    ih2d[j,l,o]) of a_y GB, X0 the direction's least bytes (every column at its cheapest),
    c[o] = max(least compute, D2H0/bw_d2h, H2D0/bw_h2d), a constant floor of t[o].

    Valid cuts, not new limits: with the set K of transfers on, the right side is
    (X0 + sum_K a)/bw + (|K| - 1)(X0/bw - c) <= (X0 + sum_K a)/bw <= t[o] (family 7), and c
    when K is empty. They tighten the LP relaxation, where a fractional level spreads its
    internals over every legal window and fills each window's idle link with a few percent
    of them, which no whole transfer can do (Llama-3.1-70B on the h800 preset: the LP bound
    lay 3.6% below the optimum without them). ms. Source: the window time's D2H / H2D term
    over binaries (docs/execution_model.md, "Window time", "Save levels").
    """
    if not p.overlap or not v.lvl:
        return
    for o in range(2 * p.L + 1):
        (comp, c0), (h2d, h0), (d2h, d0) = window_loads(v, p, o)[:3]
        least = lambda lin, k: max(0.0, k + sum(min(0.0, a) for a in lin.values()))  # noqa: E731
        h_min, d_min = least(h2d, h0), least(d2h, d0)
        floor = max(least(comp, c0), d_min / p.bw_d2h, h_min / p.bw_h2d)
        for kind, whole, x0, bw in (
                ("d2h", [(v.d2h, p.A, 1), (v.id2h, None, 2)], d_min, p.bw_d2h),
                ("h2d", [(v.h2d, p.A, 1), (v.ih2d, None, 2)], h_min, p.bw_h2d)):
            row = {}
            for fam, sizes, arity in whole:
                for key, y in fam.items():
                    if key[-1] != o:
                        continue
                    size = sizes[key[0]] if arity == 1 else p.S[key[0]][key[1] - 1]
                    slope = (x0 + size) / bw - floor
                    if slope > 0:
                        row[y] = -slope
            if row:
                m.add_row(row_name(f"transfer_cut_{kind}", window_name(o, p.L)),
                          {v.t[o]: 1.0, **row}, lb=floor)


def add_recompute_order(m: LinearModel, *, v: MilpVars, p: Scaled) -> None:
    """t[b_j] >= X[b_j]/bw_h2d + sum_s seg[s,j+1] (R[s,j+1] + B[j] + Fr[j]) - Fr[j] keep[j]
    - CUT[j] (GPU), X[b_j] = sum_i A[i] h2d[i,b_j] + P[j-1] (1 - resident[j-1]), CUT[j] the
    re-forward the save levels remove (`milp_levels.level_order_terms`),
    R[s,e] = max_{k=s..e-2} (sum_{q=s}^{k} P[q]/bw_h2d + sum_{q=k}^{e-2} F[q])  for e - s >= 2.

    A segment's recompute forward of block k waits for its weights, which queue on the H2D
    stream behind the window's activation prefetches and the next block's weights
    (`chains.recompute_chain_ms`). At most one segment ends at j + 1, so the sum picks its
    term; without a recompute segment the row is implied by the H2D row (t >= X/bw_h2d), and
    with keep[j] (or L2) the re-forward Fr[j] is not run (L1: Fr1[j] of it). No big-M. ms.
    Source: docs/execution_model.md, "In-window order".
    """
    if not p.overlap:
        return
    L = p.L
    for j in range(1, L):
        o = 2 * L - j
        if p.path_loads:  # the chain's columns give R (`milp_paths`, free weight paths)
            segs = {v.seg[s, e]: p.B[j] + p.Fr[j] for (s, e) in v.seg
                    if e == j + 1 and e - s >= 2}
        else:
            segs = {v.seg[s, e]: r + p.B[j] + p.Fr[j]
                    for (s, e), r in p.recompute_chain.items() if e == j + 1}
        if not segs:
            continue
        reload, const = reload_unless_resident(v, p, j - 1, 0)
        row = {v.t[o]: 1.0, **{x: -r for x, r in segs.items()},
               **{x: -a / p.bw_h2d for x, a in reload.items()}}
        if (j - 1, j + 1) in v.chain:
            row[v.chain[j - 1, j + 1][1]] = -1.0
        if j in v.keep:
            row[v.keep[j]] = p.Fr[j]
        row.update(level_order_terms(v, p, j))
        for (i, q), x in v.h2d.items():
            if q == o:
                row[x] = -p.A[i] / p.bw_h2d
        m.add_row(row_name("recompute_order", window_name(o, L)), row, lb=const / p.bw_h2d)


def add_hbm_capacity(m: LinearModel, *, v: MilpVars, p: Scaled) -> None:
    """held[o] + sum_{j <= o <= 2L-j} (I[j] keep[j] + P[j] resident[j]) - slack_hbm[o] <= M_hbm
    for all o.

    Checkpoint-store bytes (the contract's holding intervals; exact because D2H and H2D are
    whole, see `planner/milp.py`) plus kept internals and resident weights (`hbm_held`) must fit
    beside the fixed working set in every window. GB. Source: docs/execution_model.md, "HBM
    capacity".
    """
    for o in range(2 * p.L + 1):
        coeffs, const = hbm_held(v, p, o)
        coeffs[v.slack_hbm[o]] = -1.0
        m.add_row(row_name("hbm_cap", window_name(o, p.L)), coeffs, ub=p.hbm_cap - const)


def add_dram_capacity(m: LinearModel, *, v: MilpVars, p: Scaled) -> None:
    """sum_i A[i] dram[i] + sum_{(i,e): o in span(i,e)} Ab[i] nvb[i,e] + SAVED[o]
    - sum_j Q[j] q8[j] - slack_host[dram] <= M_dram  for the step and every o;
    nvb[i,e] >= nvme[i] + seg[i,e] - 1.

    DRAM checkpoints and the NVMe tier's bounce buffers fit beside the host optimizer states
    (8-bit moments free Q[j]) and the constant staging pools in every window. nvb[i,e]
    (auxiliary, [0, 1]) is 1 when boundary i is on NVMe with segment end e; its padded buffer
    Ab[i] counts in every window of span(i,e) = `staging.bounce_spans(i, e)`, the windows any
    legal schedule may hold it, so the rows are the evaluator's DRAM and predicted pinned bytes
    (`staging.bounce_bound_by_window`) window by window. SAVED[o]: the dram-tier saved
    internals page-locked in window o (`milp_levels.level_dram_held`, exact: whole transfers).
    A row per window some span or saved internal covers, plus the step row (the windows
    neither touches). GB. Source: docs/execution_model.md, "DRAM and NVMe capacity", "Save
    levels".
    """
    coeffs = {x: p.A[i] for i, x in v.dram.items()}
    coeffs.update({x: -p.q8_saving[j] for j, x in v.q8.items()})
    coeffs.update(pinned_copies_gb(v, p))
    coeffs[v.slack_host["dram"]] = -1.0
    m.add_row(row_name("dram_cap", "step"), coeffs, ub=p.dram_cap)
    bounce: dict[int, dict[int, float]] = {}
    for (i, e), x in v.nvb.items():
        m.add_row(row_name("nvme_bounce", i, e), {x: 1.0, v.nvme[i]: -1.0, v.seg[i, e]: -1.0},
                  lb=-1.0)
        for first, last in bounce_spans(i, e, p.L, **p.horizons):
            for o in range(first, last + 1):
                bounce.setdefault(o, {})[x] = p.A_padded[i]
    inner = {o: level_dram_held(v, p, o) for o in range(2 * p.L + 1)}
    for o in sorted(set(bounce) | {o for o, held in inner.items() if held}):
        m.add_row(row_name("dram_cap", window_name(o, p.L)),
                  {**coeffs, **bounce.get(o, {}), **inner[o]}, ub=p.dram_cap)


def add_nvme_capacity(m: LinearModel, *, v: MilpVars, p: Scaled) -> None:
    """sum_i A[i] nvme[i] - slack_host[nvme] <= M_nvme.

    NVMe checkpoints fit the scratch budget. GB. Source: docs/execution_model.md.
    """
    coeffs = {x: p.A[i] for i, x in v.nvme.items()}
    coeffs[v.slack_host["nvme"]] = -1.0
    m.add_row(row_name("nvme_cap", "step"), coeffs, ub=p.nvme_cap)

