"""Reference step times for a planning problem: LP relaxation, roofline, ideal plan.

Owns the four numbers in a Plan's `bounds` object (reported with every plan; docs/design.md,
"The plan"). "Offered" below: keep-internals and resident weights are offered together
(`allow_keep`); without them a plan that keeps or holds weights anyway is outside every bound.

- `lp_bound_ms`: the placement MILP (hard budgets) with every binary relaxed to [0, 1] and no
  tie-breakers or 8-bit penalty; a lower bound on the step time of every plan *the MILP models*
  that fits the budgets (None when not even a fractional plan fits). Proven only over that set:
  whole D2H/H2D in one window, segments of at most k_max blocks, transfers inside the horizons
  and chained ones in a later window than their source. A plan outside it (a hand-built one or
  a scheduler's split transfer) is priced by the same evaluator but may beat it. The gap of a
  plan is plan / LP - 1.
- `memory_bound_ms`: closed form, respects the HBM budget, valid for every plan that fits HBM:
  compute without segment recompute less the most that keep-internals and save levels can save
  (saved internals wait in HBM or, in the dram tier, in DRAM), and the weight
  H2D plus each boundary's way back (prefetch or reload) less the most that resident weights
  and hbm-tier boundaries can save, each in the HBM left at the turn beside the fixed working
  set and boundary L (every kept or resident block and hbm boundary is held there).
- `roofline_ms`: closed form, infinite HBM: the largest mandatory channel total with every
  block kept (or at save level L2) and resident (compute without recompute, weight H2D,
  gradient D2H, their duplex
  sum; on a CPU their sum), plus the constant pre/post/const terms. A bound, but far below
  what fits.
- `ideal_ms`: the evaluator's step time of the best infinite-HBM plan (`ideal_decisions`: every
  boundary in HBM, every block resident and kept where keeping is faster, when offered); no plan
  is faster, whatever its budgets, and it is unreachable when it does not fit.

Knows no torch; the LP goes through `solvers.solve` (lazy solver imports).
"""

from __future__ import annotations

from lazytrain.planner.duplex import effective_cap
from lazytrain.planner.evaluate import Decisions, evaluate
from lazytrain.planner.milp import build_milp
from lazytrain.planner.plan import Bounds
from lazytrain.planner.problem import PlanningProblem
from lazytrain.planner.solvers import solve
from lazytrain.planner.weight_paths import with_weight_paths
from lazytrain.planner.window_time import ends_step_ms


def lp_bound_ms(problem: PlanningProblem, *, backend: str = "highs",
                time_limit_s: float = 60.0) -> float | None:
    """Optimal value of the LP relaxation of the placement MILP (hard budgets), ms per step.

    A lower bound over the plans the MILP models (module docstring), not over every plan;
    over every per-block weight-path vector when the planner chooses the paths
    (`PlanningProblem.weight_path_choice`, `milp.build_milp(free_paths=True)`).

    Returns:
        The bound, or None when not even a fractional plan fits the budgets (then no plan does).

    Raises:
        RuntimeError: the LP did not solve to optimality.
    """
    milp = build_milp(problem, relax=True, tie_breakers=False, q8_penalty=False,
                      free_paths=problem.weight_path_choice)
    res = solve(milp.model, backend=backend, time_limit_s=time_limit_s, gap=0.0, relax=True)
    if res.status == "infeasible":
        return None
    if res.status != "optimal" or res.objective is None:
        raise RuntimeError(f"LP relaxation ended with status {res.status} ({res.detail})")
    return res.objective


def roofline_ms(problem: PlanningProblem) -> float:
    """max(mandatory compute, H2D, D2H, duplex) over the windows + constant terms, ms per step.

    Mandatory per micro-batch (window part): compute sum(min(Fg, F + Fr) + B) + head with keep
    or save levels offered (Fr: the truncated re-forward; an L2 block runs Fg and no
    re-forward, as a kept one; L1 runs Fg + Fr1 >= Fg), else sum(F + Fr + B) + head; H2D the
    forward weight
    loads P[1..L-1], plus the backward loads
    P[0..L-1] when resident weights (offered with keep) are not; D2H the gradients G[1..L-1].
    GPU: the max of compute and channel times; CPU: their sum. Step = ga * that + pre/post of
    every micro-batch (`ends_step_ms`) + const. Source: docs/execution_model.md, "Per-window
    work", "Window time" and "Step time".
    """
    p = problem
    if p.allow_keep or p.save_levels_available:
        comp = sum(min(g, f + r) for f, g, r in zip(p.fwd_ms, p.fwd_grad_ms, p.reforward))
    else:
        comp = sum(p.fwd_ms) + sum(p.reforward)
    comp += sum(p.bwd_ms) + p.turn_head_ms
    h2d = float(sum(p.weight_bytes[1:]))
    if not p.allow_keep:
        h2d += float(sum(p.weight_bytes))
    return _closed_form_step_ms(p, comp, h2d)


def _closed_form_step_ms(p: PlanningProblem, comp: float, h2d: float) -> float:
    """Step ms of a whole step's compute `comp` (ms) and H2D `h2d` (bytes) against the fixed
    gradient drains: GPU windows = max(compute, H2D/bw_h2d, D2H/bw_d2h, (H2D+D2H)/cap),
    CPU: their sum; step = ga * windows + pre/post of every micro-batch (`ends_step_ms`) +
    const. cap = max(bw_duplex, bw_h2d, bw_d2h) (`duplex.effective_cap`: a cap below a direction's own rate counts as that rate,
    as the evaluator and the simulator count it)."""
    return _step_of_windows_ms(p, _windows_ms(p, comp, h2d))


def _step_of_windows_ms(p: PlanningProblem, windows: float) -> float:
    return p.grad_accum * windows + ends_step_ms(p) + p.const_ms


def _windows_ms(p: PlanningProblem, comp: float, h2d: float, moved: float = 0.0) -> float:
    """The window part of `_closed_form_step_ms`, ms, with `moved` bytes more in each
    direction (saved internals of the dram tier, which go D2H and come back H2D)."""
    return max(comp, _links_ms(p, h2d, moved)) if p.copies_overlap_compute \
        else comp + _links_ms(p, h2d, moved)


def _links_ms(p: PlanningProblem, h2d: float, moved: float) -> float:
    """The copy terms of `_windows_ms`, ms: GPU their max, CPU their sum."""
    ms = lambda nbytes, bps: nbytes / bps * 1e3  # noqa: E731
    d2h = float(sum(p.grad_bytes[1:p.num_blocks])) + moved
    h2d += moved
    h2d_ms, d2h_ms = ms(h2d, p.h2d_bytes_per_s), ms(d2h, p.d2h_bytes_per_s)
    if p.copies_overlap_compute:
        cap = effective_cap(p.h2d_bytes_per_s, p.d2h_bytes_per_s, p.duplex_bytes_per_s)
        return max(h2d_ms, d2h_ms, ms(h2d + d2h, cap))
    return h2d_ms + d2h_ms


def memory_bound_ms(problem: PlanningProblem) -> float | None:
    """The HBM-respecting closed-form bound (module docstring), ms per step.

    room = hbm - fixed_hbm - A[L]: every kept or resident block and every hbm-tier boundary is
    held at the turn beside boundary L.

    compute = sum(F + Fr + B) + head - max sum_j sv(j) over one option per block with
    sum_j sw(j) <= room + dram_room, the options (bytes sw, saving sv): nothing (0, 0); keep
    (I[j] + P[j], F + Fr - Fg) (a kept block runs Fg in f{j} and no re-forward Fr in b{j}; its
    graph holds its weights too); L2 (S2[j], F + Fr - Fg); L1 (S1[j], F + Fr - Fg - Fr1), the
    levels when the problem offers them. Every option's bytes are held at the turn, in HBM or
    (saved internals of the dram tier) in DRAM; the w bytes in DRAM (at most dram_room = dram -
    pools - the least host states, 8-bit moments where offered) join the room and move D2H and
    back H2D, so the bound takes the least over w of the windows with compute(room + w) and
    w more bytes each way (`_least_windows_ms`).

    H2D = sum P[1..L-1] + sum P + sum_{0<i<L} m[i] - max (sum_{j in R} P[j] + sum_{i in H} m[i])
    over resident sets R and hbm-tier sets H with sum_R P[j] + sum_H A[i] <= room, where
    m[i] = min(A[i], P[i-1]): a resident block saves its backward weight load whether or not it
    keeps internals, and a boundary 0 < i < L that is not in HBM is either prefetched back
    (A[i] of H2D) or recomputed, which reloads the weights of block i-1 (P[i-1]).

    The maxima are fractional knapsacks (one option per block: the LP of the multiple-choice
    knapsack, over each block's upper hull of options), each a relaxation, so both totals are
    lower bounds.
    GPU: windows = max(compute, H2D/bw_h2d, D2H/bw_d2h, (H2D + D2H)/cap) with the duplex rule's
    cap (`duplex.effective_cap`); CPU: their sum.
    Step = ga * windows + pre/post of every micro-batch (`ends_step_ms`) + const. Source:
    docs/execution_model.md, "Per-window work", "HBM capacity" and "Step time".

    Returns:
        The bound, or None when the fixed working set and boundary L alone overflow HBM.
    """
    p, L = problem, problem.num_blocks
    room = p.hbm_bytes - p.fixed_hbm_bytes - p.boundary_bytes[L]
    if room < 0:
        return None
    P, A = p.weight_bytes, p.boundary_bytes
    blocks = range(L) if p.allow_keep else ()  # keep and residency are offered together
    items = _hull_increments([_saving_options(p, j) for j in range(L)])
    full = sum(p.fwd_ms) + sum(p.reforward) + sum(p.bwd_ms) + p.turn_head_ms
    comp = lambda moved: full - _fractional_knapsack(  # noqa: E731
        [v for v, _ in items], [w for _, w in items], room + moved)
    back = [float(min(A[i], P[i - 1])) for i in range(1, L)]  # m[i]: A back or P[i-1] again
    h2d = (float(sum(P[1:]) + sum(P)) + sum(back)
           - _fractional_knapsack([P[j] for j in blocks] + back,
                                  [P[j] for j in blocks] + [A[i] for i in range(1, L)], room))
    return _step_of_windows_ms(p, _least_windows_ms(p, comp, h2d, items, room=room,
                                                    dram_room=_dram_room(p)))


def _least_windows_ms(p: PlanningProblem, comp, h2d: float, items, *, room: float,
                      dram_room: float) -> float:
    """min over w in [0, dram_room] of `_windows_ms(p, comp(w), h2d, w)`: w bytes of saved
    internals wait in DRAM (each moves D2H and back H2D) beside the HBM `room`, comp(w) the
    compute less what room + w can save (non-increasing in w), ms. A lower bound of that
    minimum, within 1e-9 of it: GPU, the crossing of comp (falling) and the links (rising),
    bracketed by bisection (max(links(lo), comp(hi)) <= the crossing's value); CPU, the sum is
    convex and least where the next saving per byte falls below the links' ms per byte."""
    links = lambda w: _links_ms(p, h2d, w)  # noqa: E731
    if dram_room <= 0:
        return _windows_ms(p, comp(0.0), h2d)
    if not p.copies_overlap_compute:
        per_byte = 1e3 / p.h2d_bytes_per_s + 1e3 / p.d2h_bytes_per_s
        worth = sum(w for v, w in items if w > 0 and v > per_byte * w)
        w = min(dram_room, max(0.0, worth - room))
        return comp(w) + links(w)
    if comp(dram_room) >= links(dram_room):
        return comp(dram_room)
    if comp(0.0) <= links(0.0):
        return links(0.0)
    lo, hi = 0.0, dram_room
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if comp(mid) >= links(mid) else (lo, mid)
    return max(links(lo), comp(hi))


def _saving_options(p: PlanningProblem, j: int) -> list[tuple[float, float]]:
    """(bytes held at the turn, compute ms saved) of block j's options that cut its
    re-forward: keep (when offered) and save levels L2, L1 (when offered); see
    `memory_bound_ms`."""
    full = p.fwd_ms[j] + p.reforward[j] - p.fwd_grad_ms[j]  # F + Fr - Fg
    out = [(float(p.internal_bytes[j] + p.weight_bytes[j]), full)] if p.allow_keep else []
    if p.save_levels_available:
        s1, s2 = p.saved_bytes[j]
        out += [(float(s2), full), (float(s1), full - p.reforward_l1_ms[j])]
    return [(w, v) for w, v in out if v > 0]


def _dram_room(p: PlanningProblem) -> float:
    """DRAM bytes saved internals may take at most (0 without save levels): the budget less
    the constant pools and the least host states (8-bit moments on every block where
    offered); DRAM-tier boundaries, bounce buffers and pinned copies left out (a bound)."""
    if not p.save_levels_available:
        return 0.0
    bpp = min(p.host_bytes_per_param, p.host_bytes_per_param_q8) if p.allow_q8 \
        else p.host_bytes_per_param
    states = sum(p.params_per_block) * bpp + p.ends_params * p.host_bytes_per_param
    return max(0.0, p.dram_bytes - (p.nvme_staging_bytes - p.nvme_bounce_bytes) - states)


def _hull_increments(options_per_block) -> list[tuple[float, float]]:
    """(value, weight) increments of each block's upper concave hull of options (with (0, 0)):
    a fractional knapsack over them, which takes each block's increments in order since
    their ratios fall, is the LP optimum of choosing at most one option per block."""
    items = []
    for options in options_per_block:
        free = max((v for w, v in options if w <= 0), default=0.0)
        hull = [(0.0, free)]
        for w, v in sorted(((w, v) for w, v in options if w > 0), key=lambda o: (o[0], -o[1])):
            if v <= hull[-1][1]:
                continue  # heavier than a hull point and worth no more
            while len(hull) >= 2 and _slope(hull[-2], hull[-1]) <= _slope(hull[-1], (w, v)):
                hull.pop()
            hull.append((w, v))
        items.append((free, 0.0))
        items += [(b[1] - a[1], b[0] - a[0]) for a, b in zip(hull, hull[1:])]
    return items


def _slope(a: tuple[float, float], b: tuple[float, float]) -> float:
    return (b[1] - a[1]) / (b[0] - a[0])


def _fractional_knapsack(values, weights, capacity: float) -> float:
    """max sum v_j x_j with sum w_j x_j <= capacity, 0 <= x_j <= 1 (greedy by v/w; w = 0 items
    are free)."""
    total, left = 0.0, float(capacity)
    for v, w in sorted(zip(values, weights), key=lambda vw: -(vw[0] / vw[1]) if vw[1] else
                       -float("inf")):
        take = 1.0 if w <= 0 else min(1.0, left / w)
        if take <= 0:
            break
        total += v * take
        left -= w * take
    return total


def ideal_decisions(problem: PlanningProblem) -> Decisions:
    """The fastest infinite-HBM plan: every boundary hbm, every block resident, and block j kept
    where that is faster (when keep and residency are offered; else neither, and block j at
    save level L2 in HBM where that is faster, when levels are offered: `_ideal_levels`).

    With every boundary in HBM and every block resident there are no activation transfers, no
    recompute and no backward weight loads, so window f_j depends only on keep[j] (F[j] or
    Fg[j]), b_j only on keep[j] (B[j] + Fr[j] or B[j]; its weight load P[j-1] is skipped) and
    the turn on neither: the step is a sum over blocks, and each block picks the cheaper of the
    two (the evaluator prices both, so window overhead, host work and the gradient drain count).
    Every other plan moves at least these bytes and computes at least this in each window with
    its own keep set, so none is faster (`ideal_ms`).
    """
    L = problem.num_blocks
    tiers = ("hbm",) * (L + 1)
    if not problem.allow_keep:
        return _ideal_levels(problem, tiers)
    every = tuple(range(L))
    kept = evaluate(problem, Decisions(tiers=tiers, keep_internals=every)).windows
    plain = evaluate(problem, Decisions(tiers=tiers, resident_weights=every)).windows
    pair = lambda ws, j: ws[j].time_ms + ws[2 * L - j].time_ms  # noqa: E731  f_j + b_j, ms
    keep = tuple(j for j in every if pair(kept, j) <= pair(plain, j))
    return Decisions(tiers=tiers, keep_internals=keep, resident_weights=every)


def _ideal_levels(problem: PlanningProblem, tiers) -> Decisions:
    """Without keep: every block at L2 in HBM where that is faster than L0 (save levels
    offered), as `ideal_decisions` picks keep (an L2 block computes as a kept one; L1 never
    computes less than L2); no levels offered: every block L0."""
    L = problem.num_blocks
    if not problem.save_levels_available:
        return Decisions(tiers=tiers)
    saved = evaluate(problem, Decisions(tiers=tiers, save_levels=("L2",) * L,
                                        saved_tiers=("hbm",) * L)).windows
    plain = evaluate(problem, Decisions(tiers=tiers, save_levels=("L0",) * L)).windows
    pair = lambda ws, j: ws[j].time_ms + ws[2 * L - j].time_ms  # noqa: E731  f_j + b_j, ms
    l2 = [pair(saved, j) <= pair(plain, j) for j in range(L)]
    return Decisions(tiers=tiers, save_levels=tuple("L2" if x else "L0" for x in l2),
                     saved_tiers=tuple("hbm" if x else "none" for x in l2))


def ideal_ms(problem: PlanningProblem) -> float:
    """Evaluator step time of `ideal_decisions` (ignores capacities), ms per step: a lower bound
    on every plan the problem offers."""
    return evaluate(problem, ideal_decisions(problem)).step_ms


def compute_bounds(problem: PlanningProblem, *, lp: bool = True, backend: str = "highs",
                   lp_time_limit_s: float = 60.0) -> Bounds:
    """All four reference step times (lp_step_ms None when `lp` is False), ms; the LP gets
    `lp_time_limit_s` (s; math.inf under `planner.deterministic`: it runs to its optimum).
    When the planner chooses the weight paths (`PlanningProblem.weight_path_choice`) the memory
    and roofline bounds take every block pinned_copy: no landing slots in HBM, block 0's load
    the smallest and no host conversion in the ends, so they bound every path vector."""
    floor = problem
    if problem.weight_path_choice:
        floor = with_weight_paths(problem, ("pinned_copy",) * problem.num_blocks)
    return Bounds(lp_step_ms=lp_bound_ms(problem, backend=backend, time_limit_s=lp_time_limit_s)
                  if lp else None,
                  memory_step_ms=memory_bound_ms(floor),
                  roofline_step_ms=roofline_ms(floor), ideal_step_ms=ideal_ms(problem))
