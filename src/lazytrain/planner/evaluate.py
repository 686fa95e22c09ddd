"""The fluid window evaluator: step time, per-window work and memory of ANY plan.

Implements the equations of `docs/execution_model.md` exactly (per-window compute, H2D, D2H and
NVMe bytes and host time; window time as max of channels and the host on a GPU or their sum on a
CPU, and on a GPU at least the in-window stream order of `planner/chains.py`; step time with the
`pre`/`post` terms; HBM bytes held by the activation store with the exact holding intervals;
peak HBM with fixed, keep and saved-internals terms; DRAM and NVMe bytes; save levels: the
re-forward by level and the saved internals' bytes, holding and transfers). It also owns
`build_plan`, the one place a `Plan` is assembled from decisions; the transfer scheduler is
`planner/schedule.py`, and the per-window primitives both use are `planner/window_time.py`'s.

Pure Python; knows no solver and no torch. Index legend: block j = 0..L-1, boundary i = 0..L,
window ord o = 0..2L (f{j} -> j, turn -> L, b{j} -> 2L - j).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from lazytrain.planner.chains import stream_bounds_ms
from lazytrain.planner.host_bound import host_record
from lazytrain.planner.plan import (
    Bounds, InternalTransfer, Plan, Predicted, SolveRecord, Transfer, WindowRecord,
)
from lazytrain.planner.problem import PlanningProblem
from lazytrain.planner.schedule import schedule_transfers
from lazytrain.planner.staging import bounce_bound_by_window
from lazytrain.planner.weight_paths import with_weight_paths
from lazytrain.planner.window_time import (
    binding_term, ends_step_ms, fixed_loads, host_by_window_ms, q8_update_ms,
    reforward_by_level_ms, window_time_ms, with_reforward,
)
from lazytrain.planner.windows import (
    OFFLOAD_TIERS, TRANSFER_KINDS, check_tiers, horizons_of, segment_ends, segments_of, use_ord,
    window_names, window_ord,
)
from lazytrain.units import GB


@dataclass(kw_only=True, frozen=True, slots=True)
class Decisions:
    """The discrete choices of a plan plus its transfer schedule (no predictions).

    `resident_weights` defaults to `keep_internals`. Index tuples are stored sorted.
    """

    tiers: tuple[str, ...]
    keep_internals: tuple[int, ...] = ()
    resident_weights: tuple[int, ...] | None = None
    q8_blocks: tuple[int, ...] = ()
    transfers: tuple[Transfer, ...] = ()
    weight_paths: tuple[str, ...] | None = None
    """One weight path per block (`PlanningProblem.weight_paths`); None: the problem's."""
    save_levels: tuple[str, ...] | None = None
    """One of L0, L1, L2 per block. None: the planner's default (`levels_of`: every block L0,
    the truncated re-forward, when the problem has re-forward or save-level data; else none);
    (): no levels, every block re-forwards in full (a plan written before the field, the
    MegaTrain rule as published)."""
    saved_tiers: tuple[str, ...] | None = None
    """One of none, hbm, dram per block; None: "none" for every block."""
    internal_transfers: tuple[InternalTransfer, ...] = ()
    """D2H/H2D of dram-tier blocks' saved internals."""

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "tiers", tuple(self.tiers))
        set_(self, "keep_internals", tuple(sorted(self.keep_internals)))
        res = self.keep_internals if self.resident_weights is None else self.resident_weights
        set_(self, "resident_weights", tuple(sorted(res)))
        set_(self, "q8_blocks", tuple(sorted(self.q8_blocks)))
        set_(self, "transfers", tuple(self.transfers))
        if self.weight_paths is not None:
            set_(self, "weight_paths", tuple(self.weight_paths))
        for name in ("save_levels", "saved_tiers"):
            if getattr(self, name) is not None:
                set_(self, name, tuple(getattr(self, name)))
        set_(self, "internal_transfers", tuple(self.internal_transfers))

    @classmethod
    def from_plan(cls, plan: Plan) -> "Decisions":
        """The decisions a plan carries (no save levels in the plan: none, full re-forward)."""
        return cls(tiers=plan.tiers, keep_internals=plan.keep_internals,
                   resident_weights=plan.resident_weights, q8_blocks=plan.q8_blocks,
                   transfers=plan.transfers, weight_paths=plan.weight_paths,
                   save_levels=plan.save_levels, saved_tiers=plan.saved_tiers,
                   internal_transfers=plan.internal_transfers)


@dataclass(kw_only=True, frozen=True, slots=True)
class Evaluation:
    """What the fluid model predicts for one plan (per micro-batch windows, per step totals)."""

    windows: tuple[WindowRecord, ...]
    step_ms: float
    """grad_accum * micro_step_ms + const_ms + q8_update_ms."""
    micro_step_ms: float
    """Sum of window times + `ends_step_ms` / grad_accum (the mean micro-batch: `pre` loads
    block 0 in the first only, `post` prefetches it for the next)."""
    peak_hbm_bytes: float
    hbm_by_window: tuple[float, ...]
    """fixed + checkpoint + keep terms per window, in window order, bytes."""
    dram_bytes: float
    nvme_bytes: float
    violations: tuple[str, ...]
    """Capacity violations, e.g. "HBM short by 3.20 GB in window b17"."""
    feasible: bool
    hardware_flops: float
    """FLOPs per step including recompute (0 when block_fwd_flops is unknown)."""
    model_tflops: float
    hardware_tflops: float
    tokens_per_s: float
    hbm_short_bytes: float = 0.0
    dram_short_bytes: float = 0.0
    nvme_short_bytes: float = 0.0
    q8_param_fraction: float = 0.0
    """Parameters with 8-bit Adam moments / all parameters (blocks + ends)."""
    pinned_bytes: float = 0.0
    """Page-locked host bytes: DRAM-tier checkpoints, the weight staging and gradient landing
    pools, and the NVMe bounce buffers at their peak over every legal schedule
    (`staging.bounce_bound_by_window`) plus the dram-tier saved internals, at the window where
    those two peak together: the DRAM row less host states and pageable scratch."""
    host_ms_by_window: tuple[float, ...] = ()
    """Host time of each window (conversion + accumulation, `host_ms`), ms, in window order."""
    binding_by_window: tuple[str, ...] = ()
    """The term that sets each window's time (`binding_term`), in window order."""
    q8_update_ms: float = 0.0
    """The 8-bit updates' extra time on the optimizer tail, once per step, ms (`q8_update_ms`)."""

    @property
    def predicted(self) -> Predicted:
        """The Plan JSON `predicted` object."""
        return Predicted(step_ms=self.step_ms, model_tflops=self.model_tflops,
                         hardware_tflops=self.hardware_tflops, tokens_per_s=self.tokens_per_s,
                         peak_hbm_bytes=self.peak_hbm_bytes, dram_bytes=self.dram_bytes,
                         nvme_bytes=self.nvme_bytes, q8_param_fraction=self.q8_param_fraction,
                         pinned_bytes=self.pinned_bytes)


def _by_boundary(transfers, L: int) -> dict[tuple[int, str], dict[int, float]]:
    table: dict[tuple[int, str], dict[int, float]] = {}
    for t in transfers:
        cell = table.setdefault((t.boundary, t.kind), {})
        o = window_ord(t.window, L)
        cell[o] = cell.get(o, 0.0) + t.fraction
    return table


def holding_intervals(i: int, tier: str, segment_end: int, num_blocks: int, *,
                      last_d2h: int | None = None, first_h2d: int | None = None
                      ) -> list[tuple[int, int]]:
    """Window-ord intervals (inclusive) during which boundary i is held in HBM by the store.

    See `checkpoint_bytes`; `last_d2h`/`first_h2d` are ords of an offloaded boundary's last
    d2h and first h2d fractions (None: not scheduled, held from production / until release).
    """
    L = num_blocks
    if i == L:
        return [(L, L)]
    if tier == "hbm":
        return [(i, 2 * L - i)]
    if tier in OFFLOAD_TIERS:
        last = 2 * L - i if last_d2h is None else last_d2h
        first = use_ord(segment_end, L) if first_h2d is None else first_h2d
        if first <= last + 1:
            return [(i, 2 * L - i)]
        return [(i, last), (first, 2 * L - i)]
    return [(use_ord(segment_end, L), 2 * L - i)]  # recompute cache (boundary 0: re-embedded)


def checkpoint_bytes(problem: PlanningProblem, tiers, transfers) -> list[float]:
    """Bytes of boundary tensors the store holds in HBM per window (exact holding intervals).

    hbm i < L: [i, 2L-i]; boundary L: [L, L]; dram/nvme i: [i, last d2h] and
    [first h2d, 2L-i] (one interval when they touch); recompute k > 0 in segment (s, e):
    [use, 2L-k] with use = 2L-e+1; boundary 0 recompute: [use(0, e), 2L]. An offloaded boundary
    without d2h (or h2d) is held from production to use (or from use to release).

    Source: docs/execution_model.md, "HBM bytes held by the activation store".
    """
    L, A = problem.num_blocks, problem.boundary_bytes
    diff = [0.0] * (2 * L + 2)

    def hold(lo: int, hi: int, nbytes: float) -> None:
        if lo <= hi:
            diff[lo] += nbytes
            diff[hi + 1] -= nbytes

    table = _by_boundary(transfers, L)
    ends = segment_ends(tiers)
    for i, tier in enumerate(tiers):
        d, h = table.get((i, "d2h")), table.get((i, "h2d"))
        for lo, hi in holding_intervals(i, tier, ends[i] if i < L else L, L,
                                        last_d2h=max(d) if d else None,
                                        first_h2d=min(h) if h else None):
            hold(lo, hi, A[i])
    out, acc = [], 0.0
    for o in range(2 * L + 1):
        acc += diff[o]
        out.append(acc)
    return out


def levels_of(problem: PlanningProblem, decisions: Decisions
              ) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(save_levels, saved_tiers) that price `decisions`: as given, or where `save_levels` is
    None every block L0 with tier none when the problem has re-forward data (`reforward_ms`
    or `saved_bytes`: the planner's plans re-forward truncated) and no levels otherwise (both
    empty: the full re-forward, which is the same price there). `saved_tiers` None: "none"
    for every block.

    Raises:
        ValueError: `saved_tiers` of another length than `save_levels`, or levels neither
            empty nor one per block.
    """
    L = problem.num_blocks
    levels = decisions.save_levels
    if levels is None:
        levels = ("L0",) * L if problem.reforward_ms or problem.saved_bytes else ()
    tiers = ("none",) * len(levels) if decisions.saved_tiers is None else decisions.saved_tiers
    if len(levels) not in (0, L) or len(tiers) != len(levels):
        raise ValueError(f"save_levels and saved_tiers must have {L} entries each (one per "
                         f"block) or none; got {len(levels)} and {len(tiers)}")
    return tuple(levels), tuple(tiers)


@dataclass(kw_only=True, frozen=True, slots=True)
class SavedInternals:
    """Per window ord (0..2L), bytes: what L1/L2 blocks' saved internals hold and move."""

    hbm: list[float]
    """Held in HBM (`WindowRecord.hbm_saved_bytes`)."""
    dram: list[float]
    """Held in page-locked DRAM (dram tier)."""
    d2h: list[float]
    """Moved D2H by the window's internal d2h transfers."""
    h2d: list[float]
    """Moved H2D by the window's internal h2d transfers."""


def saved_internals(problem: PlanningProblem, save_levels, saved_tiers,
                    internal_transfers) -> SavedInternals:
    """Bytes of the saved internals per window, S = S1[j] at L1, S2[j] at L2 (`saved_bytes`).

    hbm tier: HBM holds S in [j, 2L - j]. dram tier: HBM holds S in [j, last d2h] and
    [first h2d, 2L - j] (from production to use where a kind has no transfer yet), DRAM from
    the first d2h to the last h2d; a d2h (h2d) fraction x adds x S to its window's D2H (H2D).
    L0 and tier none hold nothing.

    Raises:
        ValueError: a block at L1/L2 while the problem has no `saved_bytes`.

    Source: docs/execution_model.md, "Save levels".
    """
    L, n = problem.num_blocks, 2 * problem.num_blocks + 1
    out = SavedInternals(hbm=[0.0] * n, dram=[0.0] * n, d2h=[0.0] * n, h2d=[0.0] * n)
    ords: dict[tuple[int, str], list[int]] = {}
    for t in internal_transfers:
        ords.setdefault((t.block, t.kind), []).append(window_ord(t.window, L))
    for j, (level, tier) in enumerate(zip(save_levels, saved_tiers)):
        if level == "L0" or tier == "none":
            continue
        if not problem.saved_bytes:
            raise ValueError(f"block {j}: save level {level} but the problem has no saved_bytes"
                             f" (levels unavailable); use L0 or build the problem with "
                             f"planner.save_levels: true")
        size = float(problem.saved_bytes[j][0 if level == "L1" else 1])
        spans = [(j, 2 * L - j)]
        if tier == "dram":
            d2h, h2d = ords.get((j, "d2h"), []), ords.get((j, "h2d"), [])
            last, first = max(d2h, default=2 * L - j), min(h2d, default=j)
            spans = [(j, 2 * L - j)] if first <= last + 1 else [(j, last), (first, 2 * L - j)]
            for o in range(min(d2h, default=n), max(h2d, default=-1) + 1):
                out.dram[o] += size
        for lo, hi in spans:
            for o in range(lo, hi + 1):
                out.hbm[o] += size
    for t in internal_transfers:
        if t.kind not in ("d2h", "h2d") or not 0 <= t.block < L:
            raise ValueError(f"internal transfer of block {t.block} in window {t.window}: kind "
                             f"{t.kind!r} must be d2h or h2d, the block in 0..{L - 1}")
        level = save_levels[t.block] if save_levels else "L0"
        if level == "L0" or not problem.saved_bytes:
            continue  # nothing saved: moves no bytes (validation refuses the transfer)
        nbytes = float(problem.saved_bytes[t.block][0 if level == "L1" else 1])
        getattr(out, t.kind)[window_ord(t.window, L)] += nbytes * t.fraction
    return out


# ---------------------------------------------------------------------------------------------
# Evaluation


def evaluate(problem: PlanningProblem, decisions_or_plan: Decisions | Plan) -> Evaluation:
    """Evaluate a plan (or bare decisions) with the fluid window model.

    Args:
        problem: costs and capacities (one micro-batch; windows repeat grad_accum times).
        decisions_or_plan: a `Decisions` or a `Plan` (its windows/predicted are ignored).

    Returns:
        Evaluation with per-window records, step time (ms), peak HBM/DRAM/NVMe bytes and the
        capacity violations as strings naming the budget, the window and the shortfall in GB.

    Raises:
        ValueError: malformed tiers or a transfer naming an unknown window.

    Source: docs/execution_model.md (all sections).
    """
    d = decisions_or_plan
    if isinstance(d, Plan):
        d = Decisions.from_plan(d)
    if d.weight_paths is not None:
        problem = with_weight_paths(problem, d.weight_paths)
    p, L = problem, problem.num_blocks
    tiers = check_tiers(p, d.tiers)
    A = p.boundary_bytes
    levels, saved_tiers = levels_of(p, d)
    comp, h2d, d2h = fixed_loads(p, tiers, d.keep_internals, d.resident_weights,
                                 save_levels=levels)
    host = host_by_window_ms(p, tiers, d.resident_weights, d2h)  # drains only, no transfers
    saved = saved_internals(p, levels, saved_tiers, d.internal_transfers)
    h2d = [a + b for a, b in zip(h2d, saved.h2d)]
    d2h = [a + b for a, b in zip(d2h, saved.d2h)]
    nr, nw = [0.0] * (2 * L + 1), [0.0] * (2 * L + 1)
    chan = {"h2d": h2d, "d2h": d2h, "nvme_read": nr, "nvme_write": nw}
    for t in d.transfers:
        chan[t.kind][window_ord(t.window, L)] += A[t.boundary] * t.fraction
    held = checkpoint_bytes(p, tiers, d.transfers)
    keep_add = [0.0] * (2 * L + 2)
    for j in d.keep_internals:
        keep_add[j] += p.internal_bytes[j]
        keep_add[2 * L - j + 1] -= p.internal_bytes[j]
    for j in d.resident_weights:
        keep_add[j] += p.weight_bytes[j]
        keep_add[2 * L - j + 1] -= p.weight_bytes[j]
    order = stream_bounds_ms(with_reforward(p, levels), tiers, d.transfers,
                             keep_internals=d.keep_internals, resident_weights=d.resident_weights,
                             saved_h2d_bytes=saved.h2d)
    windows, hbm, acc, total, binding = [], [], 0.0, 0.0, []
    for o, name in enumerate(window_names(L)):
        t = max(window_time_ms(p, comp[o], h2d[o], d2h[o], nr[o], nw[o], host[o]),
                order[o]) + p.window_overhead_ms
        binding.append(binding_term(p, comp[o], h2d[o], d2h[o], nr[o], nw[o], host[o], order[o]))
        total += t
        acc += keep_add[o]
        hbm.append(p.fixed_hbm_bytes + held[o] + acc + saved.hbm[o])
        windows.append(WindowRecord(name=name, compute_ms=comp[o], h2d_bytes=h2d[o],
                                    d2h_bytes=d2h[o], nvme_read_bytes=nr[o],
                                    nvme_write_bytes=nw[o], time_ms=t, exposed_ms=t - comp[o],
                                    hbm_checkpoint_bytes=held[o], hbm_saved_bytes=saved.hbm[o]))
    micro = total + ends_step_ms(p) / p.grad_accum
    q8 = q8_update_ms(p, d.q8_blocks)
    step = p.grad_accum * micro + p.const_ms + q8
    return _finish(p, d, tiers, windows, hbm, micro, step, levels=levels,
                   dram_saved=saved.dram, host_ms_by_window=tuple(host),
                   binding_by_window=tuple(binding), q8_update_ms=q8)


def _finish(p: PlanningProblem, d: Decisions, tiers, windows, hbm, micro: float,
            step: float, *, levels, dram_saved, **records) -> Evaluation:
    """Capacities, violations and throughput figures (`levels`: the save levels priced;
    `dram_saved`: the saved internals held in DRAM per window ord, bytes)."""
    A = p.boundary_bytes
    q8 = set(d.q8_blocks)
    states = sum(n * (p.host_bytes_per_param_q8 if j in q8 else p.host_bytes_per_param)
                 for j, n in enumerate(p.params_per_block)) + p.ends_params * p.host_bytes_per_param
    dram_tier = sum(A[i] for i, t in enumerate(tiers) if t == "dram")
    # NVMe bounce buffers: the peak that no legal schedule of these tiers exceeds (one padded
    # buffer per NVMe boundary whose transfer windows may cover the window; planner/staging.py)
    # in place of the contract's constant pool. The MILP's DRAM rows (family 9) count the same
    # bytes per window, so dram <= budget is the row, and pinned (what the runtime page-locks:
    # everything but the states and the pageable optimizer scratch) stays within the ledger's
    # pinned budget (`budgets.plan_budgets`: the DRAM left after the states and the scratch).
    # The dram-tier saved internals are page-locked like the bounce buffers and vary by window:
    # both join the DRAM and pinned rows at the window where their sum peaks.
    bounce = max(b + s for b, s in zip(bounce_bound_by_window(A, tiers, p.num_blocks,
                                                              horizons_of(p)), dram_saved))
    pools = p.nvme_staging_bytes - p.nvme_bounce_bytes  # weight staging, grad landing, scratch
    dram = dram_tier + pools + bounce + states
    pinned = dram_tier + pools - p.host_scratch_bytes + bounce
    nvme = float(sum(A[i] for i, t in enumerate(tiers) if t == "nvme"))
    peak = max(hbm)
    violations = []
    worst = max(range(len(hbm)), key=hbm.__getitem__)
    hbm_short = max(0.0, hbm[worst] - p.hbm_bytes)
    if hbm_short > 0:
        n_over = sum(1 for b in hbm if b > p.hbm_bytes)
        violations.append(f"HBM short by {hbm_short / GB:.2f} GB in window {windows[worst].name}"
                          f" (peak {hbm[worst] / GB:.2f} GB > budget {p.hbm_bytes / GB:.2f} GB;"
                          f" {n_over} window(s) over)")
    dram_short = max(0.0, dram - p.dram_bytes)
    if dram_short > 0:
        violations.append(f"DRAM short by {dram_short / GB:.2f} GB in every window (checkpoints "
                          f"+ staging + optimizer states {dram / GB:.2f} GB > budget "
                          f"{p.dram_bytes / GB:.2f} GB)")
    nvme_short = max(0.0, nvme - p.nvme_bytes)
    if nvme_short > 0:
        violations.append(f"NVMe short by {nvme_short / GB:.2f} GB in every window "
                          f"(checkpoints {nvme / GB:.2f} GB > budget {p.nvme_bytes / GB:.2f} GB)")
    hw_flops = 0.0
    if p.block_fwd_flops:
        # the re-forward's FLOPs: the full forward's at L0 (the truncated tail not subtracted)
        # and with no levels, its Fr1/Fg share at L1, none at L2 or kept
        keep = set(d.keep_internals)
        share = [0.0 if j in keep else 1.0 if not levels or levels[j] == "L0"
                 else r / g if g > 0 else 0.0
                 for j, (r, g) in enumerate(zip(reforward_by_level_ms(p, levels), p.fwd_grad_ms))]
        extra = sum(f * share[j] for j, f in enumerate(p.block_fwd_flops))
        extra += sum(sum(p.block_fwd_flops[s:e - 1]) for s, e in segments_of(tiers))
        hw_flops = (p.hardware_flops_per_micro_batch_base + extra) * p.grad_accum
    step_s = step / 1e3
    return Evaluation(
        windows=tuple(windows), step_ms=step, micro_step_ms=micro, peak_hbm_bytes=peak,
        hbm_by_window=tuple(hbm), dram_bytes=dram, nvme_bytes=nvme, pinned_bytes=pinned,
        violations=tuple(violations), feasible=not violations, hardware_flops=hw_flops,
        model_tflops=p.model_flops_per_micro_batch * p.grad_accum / step_s / 1e12,
        hardware_tflops=hw_flops / step_s / 1e12,
        tokens_per_s=p.tokens_per_micro_batch * p.grad_accum / step_s,
        hbm_short_bytes=hbm_short, dram_short_bytes=dram_short, nvme_short_bytes=nvme_short,
        q8_param_fraction=sum(p.params_per_block[j] for j in q8)
        / max(1, sum(p.params_per_block) + p.ends_params), **records)


# ---------------------------------------------------------------------------------------------
# Plan assembly


def step_terms_of(problem: PlanningProblem) -> dict:
    """The step's plan-independent terms as stored in plan provenance["step_terms"], ms:
    {"window_overhead_ms", "step_const_ms", "embed_ms"} (the profile's figures, or 0 where not
    modelled), so the step can be re-summed from the plan alone, without its profile file
    (step = ga (pre + sum of window times + post) + step_const; docs/execution_model.md)."""
    return {"window_overhead_ms": problem.window_overhead_ms, "step_const_ms": problem.const_ms,
            "embed_ms": problem.embed_ms}


def head_terms_of(problem: PlanningProblem) -> dict:
    """What `turn` priced for the head per micro-batch, as stored in plan provenance["head"]
    (only where `head_turn_factor` is not 1, e.g. DPO's second head pass):
    {"head_ms" (one forward + backward, ms), "turn_factor", "turn_head_ms" (ms)}."""
    return {"head_ms": problem.head_ms, "turn_factor": problem.head_turn_factor,
            "turn_head_ms": problem.turn_head_ms}


def build_plan(problem: PlanningProblem, decisions: Decisions, *, solver: SolveRecord,
               bounds: Bounds | None = None) -> Plan:
    """Evaluate `decisions`, assemble the Plan (windows, predicted, provenance) and validate it.

    The plan's save levels are `levels_of(problem, decisions)` (every block L0 when the
    decisions leave them None and the problem has re-forward data; none when they give ()).
    Provenance is `problem.provenance` plus `horizons`, `k_max`, `step_terms` (`step_terms_of`),
    `host` (`host_bound.host_record`: assumed host rates, host-bound windows), `head`
    (`head_terms_of`) when the head's turn compute is not one pass, `saved_bytes`
    (the problem's [S1, S2] per block) when the plan moves saved internals, and, when a capacity
    is violated, `violations` (the plan is still returned; callers decide whether to raise).

    Raises:
        PlanValidationError: the decisions break the execution-model contract.
    """
    levels, saved_tiers = levels_of(problem, decisions)
    decisions = dataclasses.replace(_final_paths(problem, decisions), save_levels=levels,
                                    saved_tiers=saved_tiers)
    problem = with_weight_paths(problem, decisions.weight_paths)
    ev = evaluate(problem, decisions)
    L = problem.num_blocks
    kind_rank = {k: n for n, k in enumerate(TRANSFER_KINDS)}
    transfers = tuple(sorted(decisions.transfers, key=lambda t: (
        window_ord(t.window, L), t.boundary, kind_rank.get(t.kind, 9))))
    internal = tuple(sorted(decisions.internal_transfers, key=lambda t: (
        window_ord(t.window, L), t.block, kind_rank.get(t.kind, 9))))
    prov = dict(problem.provenance)
    prov.setdefault("model", problem.name)
    prov["horizons"] = horizons_of(problem)
    prov["k_max"] = problem.k_max
    prov["step_terms"] = step_terms_of(problem)
    prov["host"] = host_record(problem, ev.windows, ev.host_ms_by_window, ev.binding_by_window)
    if problem.head_turn_factor != 1.0:  # DPO; a one-pass head's plan JSON as before
        prov["head"] = head_terms_of(problem)
    if decisions.internal_transfers:  # what they move: `lazytrain report` predicts its bytes
        prov["saved_bytes"] = [list(pair) for pair in problem.saved_bytes]
    if ev.violations:
        prov["violations"] = list(ev.violations)
    plan = Plan(provenance=prov, tiers=tuple(decisions.tiers),
                keep_internals=decisions.keep_internals,
                resident_weights=tuple(decisions.resident_weights),
                q8_blocks=decisions.q8_blocks, weight_paths=decisions.weight_paths,
                save_levels=levels, saved_tiers=saved_tiers, internal_transfers=internal,
                windows=ev.windows, transfers=transfers, predicted=ev.predicted, solver=solver,
                bounds=bounds or Bounds())
    return plan.validate()


def _final_paths(problem: PlanningProblem, decisions: Decisions) -> Decisions:
    """`decisions` with their weight paths set: the problem's when they carry none, and
    host_convert for 8-bit blocks that would refresh a pinned copy (their update does not
    refresh one; masters in the compute dtype need no copy and keep their pinned path)."""
    paths = list(problem.paths if decisions.weight_paths is None else decisions.weight_paths)
    if problem.master_bytes_ratio != 1:
        for j in decisions.q8_blocks:
            if paths[j] == "pinned_copy":
                paths[j] = "host_convert"
    if set(paths) == {"host_convert"}:
        paths = []  # the Plan JSON leaves the field out: today's path
    return dataclasses.replace(decisions, weight_paths=tuple(paths))


def decisions_from_tiers(problem: PlanningProblem, tiers, keep_internals=(), *,
                         resident_weights=None, q8_blocks=(), save_levels=None,
                         saved_tiers=None) -> Decisions:
    """Decisions for a tier assignment with a legal transfer schedule (`schedule_transfers`).

    `save_levels` None: every block L0 with tier none when the problem has re-forward data
    (`levels_of`); (): no levels, every block re-forwards in full (the MegaTrain rule as
    published). `saved_tiers` None: "none" for every block. The boundaries' transfers are
    scheduled with every block's compute at L0; no saved internals are scheduled, so a block
    may not take the dram tier here.

    Raises:
        ValueError: malformed tiers, a kept block whose next boundary is recomputed, no
            legal schedule within the problem's horizons, or a dram saved tier.
    """
    tiers = check_tiers(problem, tiers)
    for j in keep_internals:
        if not 0 <= j < problem.num_blocks or tiers[j + 1] == "recompute":
            raise ValueError(f"block {j}: keep_internals needs a block index whose next boundary"
                             f" ({j + 1}) is materialized")
    transfers = schedule_transfers(problem, tiers, keep_internals,
                                   resident_weights=resident_weights)
    decisions = Decisions(tiers=tiers, keep_internals=tuple(keep_internals),
                          resident_weights=resident_weights, q8_blocks=tuple(q8_blocks),
                          transfers=transfers, save_levels=save_levels, saved_tiers=saved_tiers)
    levels, saved_tiers = levels_of(problem, decisions)
    if "dram" in saved_tiers:
        raise ValueError(f"saved_tiers: block {saved_tiers.index('dram')} is 'dram', whose "
                         f"internal transfers decisions_from_tiers does not schedule; give "
                         f"them in Decisions(internal_transfers=...) or use 'hbm'")
    return dataclasses.replace(decisions, save_levels=levels, saved_tiers=saved_tiers)
