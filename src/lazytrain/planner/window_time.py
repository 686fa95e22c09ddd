"""Per-window work and time of the fluid model: the loads every plan has before activation
transfers (`fixed_loads`), host time, the window time as max (GPU) or sum (CPU) of its terms,
the term that binds, and the step's `pre`/`post` and 8-bit update terms.

Shared by the evaluator (`planner/evaluate.py`) and the transfer scheduler
(`planner/schedule.py`), which builds on these primitives and is used by the evaluator, so both
import them from here. Pure Python; knows no solver and no torch. Index legend as in
`planner/windows.py`.

Source: docs/execution_model.md, "Per-window work", "Window time", "Host work", "Step time",
"Save levels".
"""

from __future__ import annotations

from lazytrain.planner.duplex import duplex_ms
from lazytrain.planner.problem import PlanningProblem
from lazytrain.planner.windows import segments_of


def _ms(nbytes: float, bytes_per_s: float) -> float:
    return nbytes / bytes_per_s * 1e3


def host_ms(problem: PlanningProblem, weight_bytes: float, grad_bytes: float) -> float:
    """Host time of a window, ms: weight bytes converted into staging / the conversion rate +
    drained gradient bytes added into the host accumulator / the accumulation rate (a rate of
    0 counts 0: not modelled; block gradients that land in the accumulator count 0,
    `PlanningProblem.accumulates_on_host`). The NVMe path adds nothing (O_DIRECT from the pinned bounce
    buffer, no staging memcpy); the optimizer update overlaps later windows on its own
    thread. Source: docs/execution_model.md, "Host work"."""
    p = problem
    out = 0.0
    if p.host_convert_bytes_per_s > 0:
        out += _ms(weight_bytes, p.host_convert_bytes_per_s)
    if p.host_accumulate_bytes_per_s > 0:
        out += _ms(p.block_accumulate_bytes(grad_bytes), p.host_accumulate_bytes_per_s)
    return out


def host_loads_ms(problem: PlanningProblem, converted, grad_d2h) -> list[float]:
    """Per-window host time, ms, from the weight bytes converted on the host (`weight_loads`
    with `problem.convert_bytes`) and `fixed_loads`' D2H bytes (exactly the gradient drains),
    both by ord."""
    return [host_ms(problem, w, g) for w, g in zip(converted, grad_d2h)]


def host_by_window_ms(problem: PlanningProblem, tiers, resident_weights, grad_d2h
                      ) -> list[float]:
    """`host_loads_ms` of a plan's loads: the converted weight bytes of each window from its
    tiers and resident weights, and the gradient drains `grad_d2h` (by ord)."""
    return host_loads_ms(problem, weight_loads(problem, tiers, resident_weights,
                                               problem.convert_bytes), grad_d2h)


def window_terms_ms(problem: PlanningProblem, comp: float, h2d: float, d2h: float, nr: float,
                    nw: float, host: float = 0.0) -> dict[str, float]:
    """Each term of the window time, ms: {"compute", "h2d", "d2h", "duplex", "nvme_read",
    "nvme_write", "host"} (no "duplex" on a CPU, where channels add up instead of
    overlapping). "duplex" is the time both copy directions take together, sharing the link's
    cap (`duplex.duplex_ms`). Source: docs/execution_model.md, "Window time", "Duplex
    sharing"."""
    p = problem
    terms = {"compute": comp, "h2d": _ms(h2d, p.h2d_bytes_per_s),
             "d2h": _ms(d2h, p.d2h_bytes_per_s), "nvme_read": _ms(nr, p.nvme_read_bytes_per_s),
             "nvme_write": _ms(nw, p.nvme_write_bytes_per_s), "host": host}
    if p.copies_overlap_compute:
        terms["duplex"] = duplex_ms(h2d, d2h, h2d_bytes_per_s=p.h2d_bytes_per_s,
                                    d2h_bytes_per_s=p.d2h_bytes_per_s,
                                    duplex_bytes_per_s=p.duplex_bytes_per_s)
    return terms


def window_time_ms(problem: PlanningProblem, comp: float, h2d: float, d2h: float, nr: float,
                   nw: float, host: float = 0.0) -> float:
    """Window time, ms: max of channels and the host (GPU) or compute + sum of channels and
    the host (CPU: the host work runs on the compute cores, like the copies).

    Source: docs/execution_model.md, "Per-window work", "Window time", "Host work".
    """
    terms = window_terms_ms(problem, comp, h2d, d2h, nr, nw, host)
    if problem.copies_overlap_compute:
        return max(terms.values())
    return sum(terms.values())


def binding_term(problem: PlanningProblem, comp: float, h2d: float, d2h: float, nr: float,
                 nw: float, host: float = 0.0, order_ms: float = 0.0) -> str:
    """The term that sets a GPU window's time ("compute", "h2d", ..., "host", or "order" when
    the in-window stream order bound exceeds every fluid term; ties go to compute first);
    "sum" on a CPU, where every term adds up."""
    if not problem.copies_overlap_compute:
        return "sum"
    terms = window_terms_ms(problem, comp, h2d, d2h, nr, nw, host)
    best = max(terms.values())
    if order_ms > best * (1 + 1e-9):
        return "order"
    return next(k for k, v in terms.items() if v >= best * (1 - 1e-9))


def q8_update_ms(problem: PlanningProblem, q8_blocks) -> float:
    """The 8-bit updates' extra time of one optimizer step, ms: sum over `q8_blocks` of
    params[j] / 1e9 x `q8_update_ms_per_gparam`. The updates run one after another on the
    optimizer worker, which the next step's forward waits for block by block, so a longer
    update shifts every later one and the forward that waits: charged to the step in full (the
    optimizer tail). Source: docs/execution_model.md, "Host work"."""
    return sum(problem.params_per_block[j] for j in q8_blocks) / 1e9 \
        * problem.q8_update_ms_per_gparam


def pre_ms(problem: PlanningProblem, *, load: bool = True) -> float:
    """The `pre` term, ms: the embedding forward and, with `load` (a step's first
    micro-batch), block 0's weight load (`load_bytes[0]`) and its conversion on the host
    (`convert_bytes[0]`: 0 off the host_convert path), side by side on a GPU (max: the load
    runs on the H2D stream while the embedding computes), one after the other on a CPU (sum);
    plus the window overhead `window_overhead_ms`. Without `load` (a later micro-batch, whose
    block 0 was prefetched in the previous `post`) it is the embedding alone. Source:
    docs/execution_model.md, "Step time"."""
    p = problem
    nbytes = p.load_bytes[0] if load else 0.0
    host = host_ms(p, p.convert_bytes[0] if load else 0.0, 0.0)
    return window_time_ms(p, p.embed_ms, nbytes, 0.0, 0.0, 0.0, host) + p.window_overhead_ms


def post_ms(problem: PlanningProblem, *, prefetch: bool = False) -> float:
    """The `post` term, ms: the drain of G[0] and the embedding/head gradients and their
    accumulation on the host, side by side on a GPU (max), one after the other on a CPU
    (sum); with `prefetch` (a micro-batch that another follows in the step) also block 0's
    weight load for the next micro-batch (`load_bytes[0]` on the H2D stream, sharing the link
    with the drain: the duplex rule; `convert_bytes[0]` converted on the host, one after the
    other with the accumulation). The ends' gradient (`ends_grad_bytes`), accumulated on the
    device over the step, drains only in the step's last `post` (no `prefetch`). Plus the
    window overhead `window_overhead_ms`. Source: docs/execution_model.md, "Step time"."""
    p = problem
    ends = 0 if prefetch else p.ends_grad_bytes  # drained once, in the step's last post
    drain = p.drain_bytes[0] + ends
    load = p.load_bytes[0] if prefetch else 0.0
    host = host_ms(p, p.convert_bytes[0] if prefetch else 0.0, p.grad_bytes[0])
    if p.host_accumulate_bytes_per_s > 0:  # the ends' gradient, into its accumulator
        host += _ms(ends, p.host_accumulate_bytes_per_s)
    return window_time_ms(p, 0.0, load, drain, 0.0, 0.0, host) + p.window_overhead_ms


def ends_step_ms(problem: PlanningProblem) -> float:
    """`pre` and `post` of every micro-batch of a step, ms: `pre_ms(load)` + `post_ms()` with
    grad_accum 1; else `pre_ms(load)` + (ga - 1) x (`pre_ms(no load)` + `post_ms(prefetch)`) +
    `post_ms()`: block 0's weights, unchanged within the step, load in `pre` of the first
    micro-batch and in `post` of each micro-batch that another follows. Source:
    docs/execution_model.md, "Step time"."""
    ga = problem.grad_accum
    out = pre_ms(problem) + post_ms(problem)
    if ga > 1:
        out += (ga - 1) * (pre_ms(problem, load=False) + post_ms(problem, prefetch=True))
    return out


def reforward_by_level_ms(problem: PlanningProblem, save_levels) -> tuple[float, ...]:
    """The re-forward each block's b{j} runs by its save level, ms (a kept block's 0 is the
    caller's): with no levels (an empty `save_levels`: plans before the field, the MegaTrain
    rule as published) Fg[j], the full re-forward; L0 Fr[j] (`problem.reforward`: the
    truncated re-forward, Fg where the problem has none); L1 Fr1[j] (`reforward_l1_ms`); L2 0.

    Raises:
        ValueError: `save_levels` neither empty nor one entry per block, an unknown level, or
            a block at L1 while the problem has no `reforward_l1_ms`.

    Source: docs/execution_model.md, "Save levels".
    """
    p, L = problem, problem.num_blocks
    levels = tuple(save_levels)
    if not levels:
        return tuple(p.fwd_grad_ms)
    if len(levels) != L:
        raise ValueError(f"save_levels must have {L} entries (one per block) or none; got "
                         f"{len(levels)}")
    out = []
    for j, level in enumerate(levels):
        if level == "L0":
            out.append(p.reforward[j])
        elif level == "L1":
            if not p.reforward_l1_ms:
                raise ValueError(f"block {j}: save level L1 but the problem has no "
                                 f"reforward_l1_ms (levels unavailable); use L0 or build the "
                                 f"problem with planner.save_levels: true")
            out.append(p.reforward_l1_ms[j])
        elif level == "L2":
            out.append(0.0)
        else:
            raise ValueError(f"block {j}: save level {level!r} is not one of L0, L1, L2")
    return tuple(out)


def with_reforward(problem: PlanningProblem, save_levels) -> PlanningProblem:
    """`problem` whose `reforward` is each block's re-forward by its level
    (`reforward_by_level_ms`), for the per-window terms that read `problem.reforward` (the
    in-window order of `planner/chains.py`). The L1 fields are dropped from the copy: the
    levels are already in its `reforward_ms`."""
    return problem.replace(reforward_ms=reforward_by_level_ms(problem, save_levels),
                           saved_bytes=(), reforward_l1_ms=())


def fixed_loads(problem: PlanningProblem, tiers, keep_internals=(), resident_weights=None, *,
                save_levels=None) -> tuple[list[float], list[float], list[float]]:
    """Per-window compute (ms), H2D and D2H bytes before activation transfers, by ord.

    f{j}: F[j] (Fg[j] if kept or at L1/L2); H2D P[j+1].  turn: turn_head_ms; H2D P[L-1] unless
    resident.  b{j}: B[j] + (the re-forward by level, `reforward_by_level_ms`, unless kept) +
    segment recompute sum F[s..e-2] (+ embed_ms when s == 0
    is recompute) when j = e-1; H2D P[j-1] unless resident + sum P[s..e-2]; D2H G[j+1].
    The H2D of a load is `problem.load_bytes` (P[j], or the master's bytes for gpu_cast).
    `save_levels` None prices every block at L0 (Fr[j], `problem.reforward`); saved
    internals' transfers are not in these terms (the evaluator adds them).

    Raises:
        ValueError: as `reforward_by_level_ms`.
    """
    p, L = problem, problem.num_blocks
    keep = set(keep_internals)
    if save_levels is None:
        reforward, autograd = p.reforward, keep
    else:
        reforward = reforward_by_level_ms(p, save_levels)
        autograd = keep | {j for j, level in enumerate(save_levels) if level != "L0"}
    n = 2 * L + 1
    comp, d2h = [0.0] * n, [0.0] * n
    for j in range(L):
        comp[j] = p.fwd_grad_ms[j] if j in autograd else p.fwd_ms[j]
        o = 2 * L - j
        comp[o] = p.bwd_ms[j] + (0.0 if j in keep else reforward[j])
        d2h[o] = p.drain_bytes[j + 1] if j + 1 <= L - 1 else 0.0
    comp[L] = p.turn_head_ms
    for s, e in segments_of(tiers):
        o = 2 * L - (e - 1)
        comp[o] += sum(p.fwd_ms[s:e - 1])
        if s == 0 and tiers[0] == "recompute":
            comp[o] += p.embed_ms
    resident = keep if resident_weights is None else resident_weights
    return comp, weight_loads(p, tiers, resident, p.load_bytes), d2h


def weight_loads(problem: PlanningProblem, tiers, resident_weights, per_load) -> list[float]:
    """Per-window sum of `per_load[j]` over the weight loads each window issues, by ord:
    f{j} loads block j+1; turn block L-1 unless resident; b{j} block j-1 unless resident, and
    blocks s..e-2 when j = e-1 ends segment (s, e) (recompute reloads). With
    `problem.convert_bytes` it is the bytes the host converts per window."""
    L = problem.num_blocks
    resident = set(resident_weights)
    out = [0.0] * (2 * L + 1)
    for j in range(L):
        out[j] = float(per_load[j + 1]) if j + 1 < L else 0.0
        out[2 * L - j] = float(per_load[j - 1]) if j >= 1 and j - 1 not in resident else 0.0
    out[L] = 0.0 if L - 1 in resident else float(per_load[L - 1])
    for s, e in segments_of(tiers):
        out[2 * L - (e - 1)] += float(sum(per_load[s:e - 1]))
    return out
