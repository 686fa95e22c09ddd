"""The scaled inputs of the placement MILP: the problem in model units (ms, GB, GB/ms).

Owns `Scaled` and `scale_inputs`, the model's only unit conversion (bytes -> GB, bytes/s ->
GB/ms), and the tie-breaker unit `TIE_REL`. The symbols are those of the formulation's legend
in `planner/milp.py`. Knows no variables and no rows; no solver, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lazytrain.contract import align_up
from lazytrain.planner.chains import recompute_chain_ms
from lazytrain.planner.problem import PlanningProblem
from lazytrain.planner.window_time import ends_step_ms  # the evaluator's terms, shared
from lazytrain.units import GB

TIE_REL = 1e-8
"""Tie-breaker unit as a fraction of the step's compute (sum of F, Fg, B, head): well below any
solver gap (>= 1e-6) and below the test tolerance; the sum over all tie terms stays < 1e-6 of
the step. Tie-breakers: dram costs 1 unit, nvme 2, both times (1 + i/L) (late boundaries stay in
HBM, early ones go furthest); d2h/nvw prefer early windows and h2d/nvr late ones; resident
weights cost 1 unit per block (held only where they save time)."""


@dataclass(kw_only=True, frozen=True, slots=True)
class Scaled:
    """The problem in model units: ms, GB and GB/ms (the legend of `planner/milp.py`)."""

    L: int
    F: tuple[float, ...]
    Fg: tuple[float, ...]
    Fr: tuple[float, ...]
    """The truncated re-forward in b{j} unless kept, ms (`PlanningProblem.reforward`)."""
    B: tuple[float, ...]
    S: tuple[tuple[float, float], ...]
    """(S1[j], S2[j]): block j's saved internals at L1 and L2, GB; empty: no save levels."""
    Fr1: tuple[float, ...]
    """The re-forward in b{j} at L1, ms (`PlanningProblem.reforward_l1_ms`)."""
    P: tuple[float, ...]
    Pl: tuple[float, ...]
    """H2D GB of one load of block j (P[j], or the master's bytes on the gpu_cast path)."""
    Pc: tuple[float, ...]
    """GB the host converts per load of block j (P[j] on the host_convert path, else 0)."""
    G: tuple[float, ...]
    I: tuple[float, ...]  # noqa: E741
    A: tuple[float, ...]
    A_padded: tuple[float, ...]
    """Ab[i] = align_up(A[i]): boundary i's NVMe bounce buffer, GB."""
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
    """The head's compute in `turn`, ms (`PlanningProblem.turn_head_ms`)."""
    overlap: bool
    grad_accum: int
    step_const_ms: float
    """`ends_step_ms` (pre and post of every micro-batch, each with its own window overhead)
    + ga * (2L+1) window_overhead_ms + const_ms, ms."""
    hbm_cap: float
    dram_cap: float
    nvme_cap: float
    q8_saving: tuple[float, ...]
    q8_penalty: tuple[float, ...]
    q8_update: tuple[float, ...]
    """U8[j] = params[j] / 1e9 x q8_update_ms_per_gparam: the step time block j's 8-bit
    update adds to the optimizer tail, ms (`window_time.q8_update_ms`)."""
    horizons: dict
    k_max: int
    allow_keep: bool
    allow_q8: bool
    has_nvme: bool
    tie_ms: float
    recompute_chain: dict
    """(s, e) -> R[s,e], ms, for segments with recompute (`chains.recompute_chain_ms`)."""
    path_loads: dict = field(default_factory=dict)
    """Free weight paths: {path: (H2D GB, converted GB per load of each block, ends ms)}
    (`milp_paths.free_path_loads`); empty: the problem's fixed paths (Pl, Pc)."""


def scale_inputs(problem: PlanningProblem) -> Scaled:
    """Convert bytes to GB and bytes/s to GB/ms (the only unit conversion of the model)."""
    p, L = problem, problem.num_blocks
    gb = lambda xs: tuple(x / GB for x in xs)  # noqa: E731
    per_ms = lambda bps: bps / GB / 1e3  # noqa: E731
    states = p.host_bytes_per_param * (sum(p.params_per_block) + p.ends_params)
    compute = sum(p.fwd_ms) + sum(p.fwd_grad_ms) + sum(p.bwd_ms) + p.turn_head_ms
    ref_ms = max(compute, 1e-3)
    return Scaled(
        L=L, F=tuple(p.fwd_ms), Fg=tuple(p.fwd_grad_ms), Fr=tuple(p.reforward),
        B=tuple(p.bwd_ms), S=tuple((s1 / GB, s2 / GB) for s1, s2 in p.saved_bytes),
        Fr1=tuple(p.reforward_l1_ms),
        P=gb(p.weight_bytes), Pl=gb(p.load_bytes), Pc=gb(p.convert_bytes), G=gb(p.drain_bytes),
        I=gb(p.internal_bytes), A=gb(p.boundary_bytes),
        A_padded=gb(align_up(a) for a in p.boundary_bytes),
        bw_h2d=per_ms(p.h2d_bytes_per_s), bw_d2h=per_ms(p.d2h_bytes_per_s),
        bw_x=per_ms(p.duplex_bytes_per_s), bw_nr=per_ms(p.nvme_read_bytes_per_s),
        bw_nw=per_ms(p.nvme_write_bytes_per_s), host_conv=per_ms(p.host_convert_bytes_per_s),
        host_acc=per_ms(p.host_accumulate_bytes_per_s) if p.accumulates_on_host else 0.0,
        embed=p.embed_ms, head=p.turn_head_ms,
        overlap=p.copies_overlap_compute, grad_accum=p.grad_accum,
        step_const_ms=ends_step_ms(p) + p.grad_accum * (2 * L + 1) * p.window_overhead_ms
        + p.const_ms,
        hbm_cap=(p.hbm_bytes - p.fixed_hbm_bytes) / GB,
        # the constant pools; the NVMe bounce buffers are counted per window instead
        dram_cap=(p.dram_bytes - (p.nvme_staging_bytes - p.nvme_bounce_bytes) - states) / GB,
        nvme_cap=p.nvme_bytes / GB,
        q8_saving=tuple(n * (p.host_bytes_per_param - p.host_bytes_per_param_q8) / GB
                        for n in p.params_per_block),
        q8_penalty=tuple(n / 1e9 * p.q8_penalty_ms_per_gparam for n in p.params_per_block),
        q8_update=tuple(n / 1e9 * p.q8_update_ms_per_gparam for n in p.params_per_block),
        horizons={"drain_windows": p.drain_windows, "prefetch_windows": p.prefetch_windows,
                  "nvme_lead_windows": p.nvme_lead_windows},
        k_max=p.k_max, allow_keep=p.allow_keep, allow_q8=p.allow_q8, has_nvme=p.nvme_bytes > 0,
        tie_ms=TIE_REL * ref_ms,
        recompute_chain={(s, e): recompute_chain_ms(p, s, e) for s in range(L)
                         for e in range(s + 2, min(L, s + p.k_max) + 1)})

