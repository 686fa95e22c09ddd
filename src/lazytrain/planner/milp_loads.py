"""The window loads of the placement MILP as linear expressions of its columns.

Owns `Lin` ({column: coefficient}, constant) and the window loads of the formulation in
`planner/milp.py`: compute, H2D, D2H, NVMe read and write (`window_loads`), the host work
(`window_host`) and the HBM held in a window (`hbm_held`). The constraint families
(`planner/milp_rows.py`) bound these expressions; nothing here adds a row. No solver, no torch.
"""

from __future__ import annotations

from lazytrain.planner.milp_inputs import Scaled
from lazytrain.planner.milp_levels import level_hbm_held, level_loads
from lazytrain.planner.milp_paths import block_load, cast_slots_gb
from lazytrain.planner.milp_vars import MilpVars

Lin = tuple[dict[int, float], float]
"""A linear expression: ({column: coefficient}, constant)."""


def lin_sum(*lins: Lin) -> Lin:
    """The sum of linear expressions (coefficients of a shared column add up)."""
    coeffs: dict[int, float] = {}
    for c, _ in lins:
        for x, a in c.items():
            coeffs[x] = coeffs.get(x, 0.0) + a
    return coeffs, sum(k for _, k in lins)


def lin_scale(lin: Lin, k: float) -> Lin:
    """`lin` times the constant `k`."""
    return {x: a * k for x, a in lin[0].items()}, lin[1] * k


def window_fixed_loads(v: MilpVars, p: Scaled, o: int, kind: int = 0) -> tuple[Lin, Lin, Lin]:
    """(compute ms, weight H2D GB, gradient D2H GB) of window o: the window loads before the
    plan's activation transfers (`planner/milp.py`, "Window loads"). A load of block j counts
    its H2D bytes (kind 0: `p.Pl`) or the bytes the host converts (kind 1: `p.Pc`); with free
    weight paths, the path columns' (`milp_paths.block_load`)."""
    L = p.L
    comp: dict[int, float] = {}
    h2d: dict[int, float] = {}
    d2h: dict[int, float] = {}
    if o < L:
        j = o
        c0, d0 = p.F[j], 0.0
        h2d, h0 = block_load(v, p, j + 1, kind) if j + 1 < L else ({}, 0.0)
        h2d = dict(h2d)
        if j in v.keep:
            comp[v.keep[j]] = p.Fg[j] - p.F[j]
    elif o == L:
        c0, d0 = p.head, 0.0
        h2d, h0 = reload_unless_resident(v, p, L - 1, kind)
    else:
        j = 2 * L - o
        c0, h0 = p.B[j] + p.Fr[j], 0.0
        d0 = p.G[j + 1] if j + 1 < L else 0.0
        if j in v.keep:
            comp[v.keep[j]] = -p.Fr[j]
        if j >= 1:
            h2d, h0 = reload_unless_resident(v, p, j - 1, kind)
        for (s, e), x in v.seg.items():
            if e == j + 1 and e - s >= 2:
                comp[x] = sum(p.F[s:j])
                if not p.path_loads:
                    h2d[x] = sum((p.Pl, p.Pc)[kind][s:j])
        for (k, q, e), x in v.wreload.items():
            if k == kind and e == j + 1:
                h2d[x] = 1.0
        if j + 1 in v.emb and p.embed:
            comp[v.emb[j + 1]] = p.embed
    return (comp, c0), (h2d, h0), (d2h, d0)


def reload_unless_resident(v: MilpVars, p: Scaled, j: int, kind: int) -> Lin:
    """W(j) (1 - resident[j]): block j's reload in b_{j+1} (or turn), GB."""
    if (kind, j) in v.wload:
        return {v.wload[kind, j]: 1.0}, 0.0
    coeffs, const = block_load(v, p, j, kind)
    coeffs = dict(coeffs)
    if j in v.resident:
        coeffs[v.resident[j]] = -const
    return coeffs, const


def window_host(v: MilpVars, p: Scaled, o: int) -> Lin:
    """HOST[o] = PW[o]/host_conv + GD[o]/host_acc, ms: the weight bytes the window converts
    (its loads of host_convert blocks, `p.Pc`) and the gradient bytes it drains (all of them are
    added into the host accumulator); a rate of 0 is not modelled and adds nothing."""
    _, (pw, pw0), (gd, gd0) = window_fixed_loads(v, p, o, kind=1)
    parts = []
    if p.host_conv > 0:
        parts.append(lin_scale((pw, pw0), 1 / p.host_conv))
    if p.host_acc > 0:
        parts.append(lin_scale((gd, gd0), 1 / p.host_acc))
    return lin_sum(*parts) if parts else ({}, 0.0)


def window_loads(v: MilpVars, p: Scaled, o: int) -> tuple[Lin, Lin, Lin, Lin, Lin]:
    """(compute ms, H2D GB, D2H GB, NVMe read GB, NVMe write GB) of window o (`planner/milp.py`;
    the save levels' terms: `milp_levels.level_loads`)."""
    (comp, c0), (h2d, h0), (d2h, d0) = window_fixed_loads(v, p, o)
    lv_comp, lv_h2d, lv_d2h = level_loads(v, p, o)
    comp, h2d, d2h = {**comp, **lv_comp}, {**h2d, **lv_h2d}, {**d2h, **lv_d2h}
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
    """Checkpoint-store bytes plus kept internals and resident weights held in window o, GB
    (`planner/milp.py`, held[o])."""
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
            add(x, p.I[j])
    for j, x in v.resident.items():
        if j <= o <= 2 * L - j:
            add(x, p.P[j])
    for x, a in cast_slots_gb(v).items():
        add(x, a)
    for x, a in level_hbm_held(v, p, o).items():
        add(x, a)
    return coeffs, const

