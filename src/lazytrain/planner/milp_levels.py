"""Save levels in the placement MILP (family 12 of `planner/milp.py`).

Owns the level columns (`add_level_columns`), their rows (`add_level_rows`) and the terms they
add to the window loads, the HBM rows and the DRAM rows (`level_loads`, `level_hbm_held`,
`level_dram_held`, `level_order_terms`). Block j may save its internals for b_j at level
l in {1, 2} (L1: the token mixer's side, S1[j] GB, re-forward Fr1[j]; L2: everything its
backward reads, S2[j] GB, no re-forward) in tier t in {hbm, dram}:

    lvl[j,l,t] in {0,1},  sum_{l,t} lvl[j,l,t] + keep[j] <= 1               level_one[j]
                          (only where a budget can hold S_l[j] in tier t: `level_fits`)
    dram tier, whole transfers (one window each, so HBM holding is exact):
    id2h[j,l,o] in {0,1}  o in D(j) = j+1 .. min(j + H_d, 2L-j-1)
    ih2d[j,l,o] in {0,1}  o in U(j) = max(j+1, 2L-j-H_p) .. 2L-j-1
                          (`windows.internal_legal_ords`; windows without a partner dropped)
    sum_o id2h[j,l,o] = sum_o ih2d[j,l,o] = lvl[j,l,dram]                   level_d2h/h2d_total
    cum_o ih2d[j,l] <= cum_{o-1} id2h[j,l]  (the h2d strictly after the d2h) level_h2d_after_d2h

Terms (all linear; x_l = lvl[j,l,hbm] + lvl[j,l,dram]):
    comp[f_j] += (Fg[j] - F[j]) (x_1 + x_2)        (a saving forward runs with autograd)
    comp[b_j] -= (Fr[j] - Fr1[j]) x_1 + Fr[j] x_2   (L1 re-forwards the rest, L2 nothing)
    D2H[o] += S_l[j] id2h[j,l,o];  H2D[o] += S_l[j] ih2d[j,l,o]
    held[o] += S_l[j] lvl[j,l,hbm] (j <= o <= 2L-j)
             + S_l[j] sum_{q >= o} id2h[j,l,q] (o >= j) + S_l[j] sum_{q <= o} ih2d[j,l,q] (o <= 2L-j)
    DRAM[o] += S_l[j] (sum_{q <= o} id2h[j,l,q] - sum_{q <= o-1} ih2d[j,l,q])
             (page-locked from the d2h window to the h2d window, both included)
    recompute_order[b_j]: the same b_j compute terms (the in-window order counts no saved
             internals' h2d before the recompute loads, as `chains.stream_bounds_ms` does)

Every term is exact for whole transfers. Nothing is built when the problem offers no levels
(`PlanningProblem.saved_bytes` empty). Pure Python; no solver, no torch.
Source: docs/execution_model.md, "Save levels".
"""

from __future__ import annotations

from lazytrain.planner.milp_inputs import Scaled
from lazytrain.planner.milp_vars import MilpVars, row_name
from lazytrain.planner.solvers import LinearModel
from lazytrain.planner.windows import internal_legal_ords, window_name

LEVELS = (1, 2)
"""Save levels the model offers (L1, L2); L0 is every level column at 0."""
LEVEL_TIERS = ("hbm", "dram")
"""Where a saving block's internals wait for b_j."""


def level_windows(p: Scaled, j: int) -> tuple[list[int], list[int]]:
    """(d2h ords, h2d ords) a dram-tier block j may use: the contract's legal windows, less a
    d2h window with no later h2d window and an h2d window with no earlier d2h window. Both
    empty: block j cannot take the dram tier."""
    kw = {"drain_windows": p.horizons["drain_windows"],
          "prefetch_windows": p.horizons["prefetch_windows"]}
    d2h = list(internal_legal_ords("d2h", j, p.L, **kw))
    h2d = list(internal_legal_ords("h2d", j, p.L, **kw))
    if not d2h or not h2d:
        return [], []
    d2h = [o for o in d2h if o < h2d[-1]]
    h2d = [o for o in h2d if o > d2h[0]] if d2h else []
    return (d2h, h2d) if d2h and h2d else ([], [])


def level_fits(p: Scaled, j: int, level: int, tier: str, *, dram_windows: bool) -> bool:
    """Whether block j's internals at `level` can wait in `tier` in any plan: in HBM they are
    held in f_j beside nothing else of the plan's (S <= M_hbm) and, in the hbm tier, at the turn
    beside boundary L (S + A[L] <= M_hbm); in the dram tier a legal window pair exists and
    DRAM holds them beside nothing else (S <= M_dram + sum_j Q[j], every block's 8-bit saving
    where offered). A level that fails gets no column (a
    capacity no plan meets, so the model stays exact and smaller: the seed offers L1 only on
    its 16 full-attention blocks)."""
    size = p.S[j][level - 1]
    if size > p.hbm_cap:
        return False
    if tier == "hbm":
        return size + p.A[p.L] <= p.hbm_cap
    return dram_windows and size <= p.dram_cap + (sum(p.q8_saving) if p.allow_q8 else 0.0)


def add_level_columns(m: LinearModel, v: MilpVars, p: Scaled, *, relax: bool) -> None:
    """The lvl, id2h and ih2d columns (module docstring); none without levels. Tie-breakers:
    the dram tier costs one `tie_ms` unit (internals stay in HBM where that is as fast), a d2h
    prefers early windows and an h2d late ones, as the boundaries' do."""
    if not p.S:
        return
    L, binary = p.L, not relax
    for j in range(L):
        d2h, h2d = level_windows(p, j)
        for level in LEVELS:
            for tier in LEVEL_TIERS:
                if not level_fits(p, j, level, tier, dram_windows=bool(d2h)):
                    continue
                v.lvl[j, level, tier] = m.add_var(
                    row_name("lvl", j, f"L{level}", tier), ub=1, integer=binary,
                    obj=p.tie_ms if tier == "dram" else 0.0)
            if (j, level, "dram") not in v.lvl:
                continue
            for o in d2h:
                v.id2h[j, level, o] = m.add_var(
                    row_name("id2h", j, f"L{level}", window_name(o, L)), ub=1, integer=binary,
                    obj=p.tie_ms * (o - j) / (2 * L))
            for o in h2d:
                v.ih2d[j, level, o] = m.add_var(
                    row_name("ih2d", j, f"L{level}", window_name(o, L)), ub=1, integer=binary,
                    obj=p.tie_ms * (2 * L - o) / (2 * L))


def _ords(fam: dict, j: int, level: int) -> list[int]:
    return sorted(o for (b, lv, o) in fam if b == j and lv == level)


def add_level_rows(m: LinearModel, *, v: MilpVars, p: Scaled) -> None:
    """sum_{l,t} lvl[j,l,t] + keep[j] <= 1;  sum_o id2h[j,l,o] = sum_o ih2d[j,l,o] =
    lvl[j,l,dram];  cum_o ih2d[j,l] <= cum_{o-1} id2h[j,l].

    A block saves at one level in one tier, or keeps its graph, or neither; a dram-tier block's
    internals leave HBM in one window and come back in one strictly later window (an h2d in or
    before its d2h window would adopt the copy still held). Dimensionless. Source:
    docs/execution_model.md, "Save levels" (rules).
    """
    blocks = sorted({j for (j, _, _) in v.lvl})
    for j in blocks:
        row = {c: 1.0 for (b, _, _), c in v.lvl.items() if b == j}
        if j in v.keep:
            row[v.keep[j]] = 1.0
        m.add_row(row_name("level_one", j), row, ub=1)
        for level in LEVELS:
            if (j, level, "dram") not in v.lvl:
                continue
            x = v.lvl[j, level, "dram"]
            d2h, h2d = _ords(v.id2h, j, level), _ords(v.ih2d, j, level)
            for kind, fam, ords in (("d2h", v.id2h, d2h), ("h2d", v.ih2d, h2d)):
                m.add_row(row_name(f"level_{kind}_total", j, f"L{level}"),
                          {**{fam[j, level, o]: 1.0 for o in ords}, x: -1.0}, lb=0, ub=0)
            for o in h2d:
                if o - 1 >= d2h[-1]:
                    break  # every d2h window is before o: implied by the totals
                row = {v.ih2d[j, level, q]: 1.0 for q in h2d if q <= o}
                row.update({v.id2h[j, level, q]: -1.0 for q in d2h if q <= o - 1})
                m.add_row(row_name("level_h2d_after_d2h", j, f"L{level}", window_name(o, p.L)),
                          row, ub=0)


def _saving(v: MilpVars, j: int, level: int) -> list[int]:
    """x_l = the lvl columns of block j at `level` (both tiers)."""
    return [v.lvl[j, level, t] for t in LEVEL_TIERS if (j, level, t) in v.lvl]


def reforward_cut(v: MilpVars, p: Scaled, j: int) -> dict[int, float]:
    """{column: ms} that b_j's re-forward Fr[j] loses: (Fr - Fr1) per L1 column, Fr per L2."""
    out = {c: p.Fr[j] - p.Fr1[j] for c in _saving(v, j, 1)}
    out.update({c: p.Fr[j] for c in _saving(v, j, 2)})
    return out


def level_loads(v: MilpVars, p: Scaled, o: int
                ) -> tuple[dict[int, float], dict[int, float], dict[int, float]]:
    """(compute ms, H2D GB, D2H GB) the level columns add to window o (module docstring)."""
    comp: dict[int, float] = {}
    if not v.lvl:
        return comp, {}, {}
    L = p.L
    if o < L:
        comp = {c: p.Fg[o] - p.F[o] for lv in LEVELS for c in _saving(v, o, lv)}
    elif o > L:
        comp = {c: -ms for c, ms in reforward_cut(v, p, 2 * L - o).items()}
    h2d = {c: p.S[j][lv - 1] for (j, lv, q), c in v.ih2d.items() if q == o}
    d2h = {c: p.S[j][lv - 1] for (j, lv, q), c in v.id2h.items() if q == o}
    return comp, h2d, d2h


def level_hbm_held(v: MilpVars, p: Scaled, o: int) -> dict[int, float]:
    """Saved internals held in HBM in window o, GB per column (module docstring, held[o])."""
    L, out = p.L, {}
    for (j, lv, tier), c in v.lvl.items():
        if tier == "hbm" and j <= o <= 2 * L - j:
            out[c] = p.S[j][lv - 1]
    for (j, lv, q), c in v.id2h.items():
        if j <= o <= q:
            out[c] = p.S[j][lv - 1]
    for (j, lv, q), c in v.ih2d.items():
        if q <= o <= 2 * L - j:
            out[c] = p.S[j][lv - 1]
    return out


def level_dram_held(v: MilpVars, p: Scaled, o: int) -> dict[int, float]:
    """Saved internals held in DRAM (page-locked) in window o, GB per column: from the d2h
    window to the h2d window, both included. Written with the fewest columns: the d2h columns
    up to o while a d2h may still be pending, else lvl less the h2d columns before o."""
    out: dict[int, float] = {}
    for (j, lv, tier), x in v.lvl.items():
        if tier != "dram":
            continue
        size = p.S[j][lv - 1]
        d2h, h2d = _ords(v.id2h, j, lv), _ords(v.ih2d, j, lv)
        if o < d2h[0] or o > h2d[-1]:
            continue
        if o < d2h[-1]:
            out.update({v.id2h[j, lv, q]: size for q in d2h if q <= o})
            out.update({v.ih2d[j, lv, q]: -size for q in h2d if q <= o - 1})
        else:
            out[x] = size
            out.update({v.ih2d[j, lv, q]: -size for q in h2d if q <= o - 1})
    return out


def level_order_terms(v: MilpVars, p: Scaled, j: int) -> dict[int, float]:
    """recompute_order[b_j] terms, ms per column, on the row's `t - ... >= ...` side: the
    re-forward the levels remove (+ `reforward_cut`)."""
    return reforward_cut(v, p, j)
