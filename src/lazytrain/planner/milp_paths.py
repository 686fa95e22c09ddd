"""Per-block weight-path choice in the placement MILP (family 11 of `planner/milp.py`).

Owns `free_path_loads` (the per-path load and conversion bytes, `Scaled.path_loads`),
`add_path_columns` (the columns) and `add_path_rows` (their rows). With masters in another
dtype than the compute dtype (ratio r = master/compute bytes != 1) and `build_milp(...,
free_paths=True)`, block j takes one of `WEIGHT_PATH_NAMES`:

    path[j,w] in {0,1},  sum_w path[j,w] = 1;  path[j,pinned_copy] + q8[j] <= 1
    H2D GB of one load:      Wl(j) = sum_w Pl_w[j] path[j,w]   (Pl = P, P, r P)
    converted GB of a load:  Wc(j) = P[j] path[j,host_convert]
    wload[k,j]   >= W_k(j) - max_w W_k,w[j] resident[j]         (= W_k(j) (1 - resident[j]))
    wreload[k,q,e] >= W_k(q) - max_w W_k,w[q] (1 - in[q,e]),  in[q,e] = sum_{s<=q} seg[s,e]
                 (block q is reloaded for the recompute of the segment ending at e, q <= e-2)
    cast_max     >= r P[j] path[j,gpu_cast]: the HBM rows hold SLOTS x cast_max
    DRAM rows    + P[j] path[j,pinned_copy] (the pinned compute-dtype copy)
    recompute chain of the segment ending at e (GPU):
        ld[q,e] >= ld[q-1,e] + wreload[load,q,e] / bw_h2d
        cf[q,e] >= cf[q-1,e] + F[q] in[q,e];  cf[q,e] >= ld[q,e] + F[q] in[q,e]
        so cf[e-2,e] = R[s,e] = max_q (sum_{s..q} Wl/bw + sum_{q..e-2} F) (`chains`)
    objective    + (C_w - C_base) path[0,w]: block 0's load and conversion in the ends of
                 the micro-batches (C: the step constant with block 0 on path w)

(k: "load" or "convert"). Every auxiliary column appears with a positive coefficient in rows
that bound a window time from below (or in capacity rows as an upper bound on held bytes), so
the least value the rows allow is the product it stands for: exact, no big-M. With fixed paths
(the default) nothing here is built and the loads are the problem's constants.

Pure Python; no solver, no torch. Source: docs/execution_model.md, "Weight paths".
"""

from __future__ import annotations

from lazytrain.contract import GPU_CAST_LANDING_SLOTS, WEIGHT_PATH_NAMES
from lazytrain.planner.milp_inputs import Scaled, scale_inputs
from lazytrain.planner.milp_vars import MilpVars, row_name
from lazytrain.planner.problem import PlanningProblem
from lazytrain.planner.solvers import LinearModel
from lazytrain.planner.weight_paths import with_weight_paths
from lazytrain.units import GB

LOAD_KINDS = ("load", "convert")
"""What a block load costs: H2D GB ("load") and GB converted on the host ("convert")."""


def free_path_loads(problem: PlanningProblem) -> dict:
    """{path: (H2D GB per load, converted GB per load, ends ms)} of every block on each path,
    for a problem planned with every block on host_convert (`with_weight_paths(problem, ())`);
    ends ms: the step constant's change when block 0 takes the path (its load and conversion
    in the ends of the micro-batches, `Scaled.step_const_ms`). Empty when the masters are in
    the compute dtype (no choice: pinned in place)."""
    if problem.master_bytes_ratio == 1:
        return {}
    L, out = problem.num_blocks, {}
    base = scale_inputs(problem).step_const_ms
    for path in WEIGHT_PATH_NAMES:
        q = with_weight_paths(problem, (path,) * L)
        out[path] = (tuple(b / GB for b in q.load_bytes), tuple(b / GB for b in q.convert_bytes),
                     scale_inputs(q).step_const_ms - base)
    return out


def _most(p: Scaled, kind: int, j: int) -> float:
    return max(loads[kind][j] for loads in p.path_loads.values())


def block_load(v: MilpVars, p: Scaled, j: int, kind: int) -> tuple[dict[int, float], float]:
    """W_kind(j), GB per load of block j: a constant with fixed paths, else the path columns'."""
    if not p.path_loads:
        return {}, (p.Pl, p.Pc)[kind][j]
    return {v.path[j, w]: loads[kind][j] for w, loads in p.path_loads.items()
            if loads[kind][j]}, 0.0


def add_path_columns(m: LinearModel, v: MilpVars, p: Scaled, *, relax: bool,
                     shortfall: bool) -> None:
    """The path, wload, wreload, cast_max and chain columns (module docstring); none with
    fixed paths. pre's per-path difference goes in the path[0, w] objective terms."""
    if not p.path_loads:
        return
    L = p.L
    for j in range(L):
        for w, loads in p.path_loads.items():
            obj = loads[2] if j == 0 and not shortfall else 0.0
            v.path[j, w] = m.add_var(row_name("path", j, w), ub=1, integer=not relax, obj=obj)
    for kind in range(len(LOAD_KINDS)):
        for j in v.resident:
            v.wload[kind, j] = m.add_var(row_name("wload", LOAD_KINDS[kind], j))
        for (s, e) in v.seg:
            for q in range(s, e - 1):
                if (kind, q, e) not in v.wreload:
                    v.wreload[kind, q, e] = m.add_var(row_name("wreload", LOAD_KINDS[kind], q, e))
    v.cast_max[0] = m.add_var(row_name("cast_max", 0))
    if p.overlap:
        for (_, q, e) in v.wreload:
            v.chain[q, e] = (m.add_var(row_name("ld", q, e)), m.add_var(row_name("cf", q, e)))


def reloaded(v: MilpVars, q: int, e: int) -> dict[int, float]:
    """in[q,e] = sum_{s <= q, e - s >= 2} seg[s,e]: block q is reloaded in b_{e-1}."""
    return {x: 1.0 for (s, f), x in v.seg.items() if f == e and s <= q < e - 1}


def add_path_rows(m: LinearModel, *, v: MilpVars, p: Scaled) -> None:
    """sum_w path[j,w] = 1; pinned_copy excludes q8; the wload / wreload / cast_max / chain
    definitions (module docstring). Dimensionless, GB and ms. Source: docs/execution_model.md,
    "Weight paths" and "In-window order"."""
    if not p.path_loads:
        return
    for j in range(p.L):
        m.add_row(row_name("one_path", j), {v.path[j, w]: 1.0 for w in p.path_loads},
                  lb=1, ub=1)
        if j in v.q8:
            m.add_row(row_name("q8_not_pinned", j), {v.path[j, "pinned_copy"]: 1.0,
                                                     v.q8[j]: 1.0}, ub=1)
        cast = p.path_loads["gpu_cast"][0][j]
        m.add_row(row_name("cast_max", j), {v.cast_max[0]: 1.0, v.path[j, "gpu_cast"]: -cast},
                  lb=0)
    for (kind, j), x in v.wload.items():
        coeffs, _ = block_load(v, p, j, kind)
        m.add_row(row_name("wload", LOAD_KINDS[kind], j),
                  {x: 1.0, **{c: -a for c, a in coeffs.items()},
                   v.resident[j]: _most(p, kind, j)}, lb=0)
    for (kind, q, e), x in v.wreload.items():
        coeffs, _ = block_load(v, p, q, kind)
        most = _most(p, kind, q)
        row = {x: 1.0, **{c: -a for c, a in coeffs.items()}}
        for c in reloaded(v, q, e):
            row[c] = -most
        m.add_row(row_name("wreload", LOAD_KINDS[kind], q, e), row, lb=-most)
    for (q, e), (ld, cf) in v.chain.items():
        prev = v.chain.get((q - 1, e))
        inn = reloaded(v, q, e)
        m.add_row(row_name("chain_ld", q, e), {ld: 1.0, v.wreload[0, q, e]: -1 / p.bw_h2d,
                                               **({prev[0]: -1.0} if prev else {})}, lb=0)
        m.add_row(row_name("chain_cf", q, e), {cf: 1.0, **{c: -p.F[q] for c in inn},
                                               **({prev[1]: -1.0} if prev else {})}, lb=0)
        m.add_row(row_name("chain_cl", q, e), {cf: 1.0, ld: -1.0,
                                               **{c: -p.F[q] for c in inn}}, lb=0)


def cast_slots_gb(v: MilpVars) -> dict[int, float]:
    """The gpu_cast landing slots in every HBM row: SLOTS x cast_max, GB."""
    return {v.cast_max[0]: float(GPU_CAST_LANDING_SLOTS)} if v.cast_max else {}


def pinned_copies_gb(v: MilpVars, p: Scaled) -> dict[int, float]:
    """The pinned compute-dtype copies in every DRAM row: P[j] path[j,pinned_copy], GB."""
    if not p.path_loads:
        return {}
    return {v.path[j, "pinned_copy"]: p.P[j] for j in range(p.L)}
