"""The window loads of the placement MILP as linear expressions of its columns.

Owns `Lin` ({column: coefficient}, constant) and the window loads of the formulation in
`planner/milp.py`: compute, H2D, D2H, NVMe read and write (`window_loads`), the host work
(`window_host`) and the HBM held in a window (`hbm_held`). The constraint families
(`planner/milp_rows.py`) bound these expressions; nothing here adds a row. No solver, no torch.
"""

from __future__ import annotations

from lazytrain.planner.milp_inputs import Scaled
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


def window_fixed_loads(v: MilpVars, p: Scaled, o: int, per_load=None) -> tuple[Lin, Lin, Lin]:
    """(compute ms, weight H2D GB, gradient D2H GB) of window o: the window loads before the
    plan's activation transfers (`planner/milp.py`, "Window loads"). A load of block j counts
    `per_load[j]` GB (default `p.Pl`, its H2D bytes; `p.Pc` gives the converted bytes)."""
    L = p.L
    W = p.Pl if per_load is None else per_load
    comp: dict[int, float] = {}
    h2d: dict[int, float] = {}
    d2h: dict[int, float] = {}
    if o < L:
        j = o
        c0, h0, d0 = p.F[j], (W[j + 1] if j + 1 < L else 0.0), 0.0
        if j in v.keep:
            comp[v.keep[j]] = p.Fg[j] - p.F[j]
    elif o == L:
        c0, h0, d0 = p.head, W[L - 1], 0.0
        if L - 1 in v.resident:
            h2d[v.resident[L - 1]] = -W[L - 1]
    else:
        j = 2 * L - o
        c0, h0 = p.B[j] + p.Fg[j], (W[j - 1] if j >= 1 else 0.0)
        d0 = p.G[j + 1] if j + 1 < L else 0.0
        if j in v.keep:
            comp[v.keep[j]] = -p.Fg[j]
        if j >= 1 and j - 1 in v.resident:
            h2d[v.resident[j - 1]] = -W[j - 1]
        for (s, e), x in v.seg.items():
            if e == j + 1 and e - s >= 2:
                comp[x] = sum(p.F[s:j])
                h2d[x] = sum(W[s:j])
        if j + 1 in v.emb and p.embed:
            comp[v.emb[j + 1]] = p.embed
    return (comp, c0), (h2d, h0), (d2h, d0)


def window_host(v: MilpVars, p: Scaled, o: int) -> Lin:
    """HOST[o] = PW[o]/host_conv + GD[o]/host_acc, ms: the weight bytes the window converts
    (its loads of host_convert blocks, `p.Pc`) and the gradient bytes it drains (all of them are
    added into the host accumulator); a rate of 0 is not modelled and adds nothing."""
    _, (pw, pw0), (gd, gd0) = window_fixed_loads(v, p, o, p.Pc)
    parts = []
    if p.host_conv > 0:
        parts.append(lin_scale((pw, pw0), 1 / p.host_conv))
    if p.host_acc > 0:
        parts.append(lin_scale((gd, gd0), 1 / p.host_acc))
    return lin_sum(*parts) if parts else ({}, 0.0)


def window_loads(v: MilpVars, p: Scaled, o: int) -> tuple[Lin, Lin, Lin, Lin, Lin]:
    """(compute ms, H2D GB, D2H GB, NVMe read GB, NVMe write GB) of window o (`planner/milp.py`)."""
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
    return coeffs, const

