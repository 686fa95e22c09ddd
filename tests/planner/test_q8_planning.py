"""The planner's per-block 8-bit Adam states (q8[j] in the DRAM row, penalised per parameter).

References are independent of the MILP: a brute-force search over block subsets for the fewest
8-bit parameters that close a DRAM shortfall (arithmetic in the test), and, for the NVMe-vs-8-bit
choice, the joint optimum compared with the two restricted optima (8-bit switched off; NVMe
switched off) whose costs are evaluated by the fluid evaluator plus the stated 8-bit penalty.
"""

from __future__ import annotations

import itertools

import pytest

from lazytrain.contract import align_up
from lazytrain.planner.evaluate import evaluate
from lazytrain.planner.milp_solve import solve_milp
from lazytrain.planner.problem import PlanningProblem

pytest.importorskip("highspy", reason="the MILP needs a solver")

MB = 10**6
PARAMS = (3 * MB, 5 * MB, 7 * MB, 11 * MB)
"""Unequal blocks, so the fewest-parameters subset is not just the fewest blocks."""
ENDS = 4 * MB
BPP, BPP_Q8 = 16.0, 10.0
STATES = BPP * (sum(PARAMS) + ENDS)
"""fp32 master + grads + Adam moments: 16 B x 30e6 = 480 MB."""


def states_problem(dram_bytes: float, **kw) -> PlanningProblem:
    """4 blocks whose checkpoints all fit HBM (so DRAM holds only the optimizer states)."""
    L = len(PARAMS)
    base = dict(
        fwd_ms=(10.0,) * L, fwd_grad_ms=(12.0,) * L, bwd_ms=(20.0,) * L,
        weight_bytes=tuple(2 * n for n in PARAMS), grad_bytes=tuple(2 * n for n in PARAMS),
        internal_bytes=(4 * MB,) * L, boundary_bytes=(MB,) * (L + 1),
        params_per_block=PARAMS, ends_params=ENDS, h2d_bytes_per_s=25e9, d2h_bytes_per_s=25e9,
        duplex_bytes_per_s=40e9, nvme_read_bytes_per_s=5e9, nvme_write_bytes_per_s=5e9,
        hbm_bytes=10**10, dram_bytes=int(dram_bytes), nvme_bytes=0,
        host_bytes_per_param=BPP, host_bytes_per_param_q8=BPP_Q8, allow_q8=True,
        q8_penalty_ms_per_gparam=100.0, allow_keep=False)
    base.update(kw)
    return PlanningProblem(**base)


def fewest_q8_params(shortfall_bytes: float) -> int:
    """Brute force over all block subsets: the smallest parameter count whose 8-bit saving
    (6 B per parameter) covers the shortfall."""
    best = None
    for r in range(len(PARAMS) + 1):
        for subset in itertools.combinations(PARAMS, r):
            if (BPP - BPP_Q8) * sum(subset) >= shortfall_bytes:
                best = sum(subset) if best is None else min(best, sum(subset))
    return best


def test_dram_5_percent_short_switches_the_fewest_parameters_to_8bit():
    dram = 0.95 * STATES  # 456 MB for 480 MB of fp32 states: 24 MB short
    problem = states_problem(dram)
    plan = solve_milp(problem, backend="highs", gap=0.0, time_limit_s=30)
    q8_params = sum(PARAMS[j] for j in plan.q8_blocks)
    # 24 MB / 6 B = 4e6 parameters needed: block 1 (5e6) is the smallest subset that covers it
    assert fewest_q8_params(STATES - dram) == 5 * MB
    assert q8_params == 5 * MB and plan.q8_blocks == (1,)
    assert plan.predicted.q8_param_fraction == pytest.approx(5 / 30)
    assert plan.predicted.dram_bytes <= dram
    assert "violations" not in plan.provenance


@pytest.mark.parametrize("short_fraction", [0.05, 0.12, 0.30])
def test_q8_parameter_count_equals_brute_force_for_several_shortfalls(short_fraction):
    dram = (1 - short_fraction) * STATES
    plan = solve_milp(states_problem(dram), backend="highs", gap=0.0, time_limit_s=30)
    assert sum(PARAMS[j] for j in plan.q8_blocks) == fewest_q8_params(STATES - dram)
    assert evaluate(states_problem(dram), plan).feasible


def test_no_block_is_8bit_when_dram_suffices():
    plan = solve_milp(states_problem(STATES + 10 * MB), backend="highs", gap=0.0,
                      time_limit_s=30)
    assert plan.q8_blocks == () and plan.predicted.q8_param_fraction == 0.0


# --- NVMe checkpoints vs 8-bit states -----------------------------------------------------------

A = 100 * MB
"""Boundary bytes: HBM holds about two beside the fixed set, so some must leave HBM."""
P = 20 * MB
"""Parameters per block: one block's 8-bit saving (6 B x 20e6 = 120 MB) frees one boundary."""


def offload_problem(*, q8_ms_per_gparam: float, nvme_bytes_per_s: float, **kw
                    ) -> PlanningProblem:
    """Six blocks; DRAM holds the fp32 states and one boundary more (one DRAM-tier checkpoint,
    or the bounce buffer of one NVMe boundary in flight: more checkpoints need 8-bit blocks or
    NVMe); horizons of one window, so every other boundary can go to NVMe through that one
    buffer; NVMe holds every boundary; recompute is expensive (F = 50 ms)."""
    L = 6
    states = BPP * (L * P)
    base = dict(
        fwd_ms=(50.0,) * L, fwd_grad_ms=(55.0,) * L, bwd_ms=(100.0,) * L,
        weight_bytes=(2 * P,) * L, grad_bytes=(2 * P,) * L, internal_bytes=(A,) * L,
        boundary_bytes=(A,) * (L + 1), params_per_block=(P,) * L,
        h2d_bytes_per_s=25e9, d2h_bytes_per_s=25e9, duplex_bytes_per_s=40e9,
        nvme_read_bytes_per_s=nvme_bytes_per_s, nvme_write_bytes_per_s=nvme_bytes_per_s,
        hbm_bytes=int(2.5 * A), dram_bytes=int(states) + align_up(A), nvme_bytes=10 * A,
        drain_windows=1, prefetch_windows=1, nvme_lead_windows=1,
        host_bytes_per_param=BPP, host_bytes_per_param_q8=BPP_Q8, allow_q8=True,
        q8_penalty_ms_per_gparam=q8_ms_per_gparam, allow_keep=False)
    base.update(kw)
    return PlanningProblem(**base)


def cost_ms(problem: PlanningProblem, plan) -> float:
    """The stated cost the planner minimises: evaluated step time + 8-bit penalty."""
    q8 = sum(problem.params_per_block[j] for j in plan.q8_blocks)
    return evaluate(problem, plan).step_ms + q8 / 1e9 * problem.q8_penalty_ms_per_gparam


CASES = {
    # 8-bit costs 0.02 ms per block; an NVMe round trip of 100 MB at 0.1 GB/s exposes ~1 s
    "cheap_q8_slow_nvme": dict(q8_ms_per_gparam=1.0, nvme_bytes_per_s=0.1e9),
    # 8-bit costs 200 ms per block; NVMe at 25 GB/s hides under the 50-155 ms windows
    "costly_q8_fast_nvme": dict(q8_ms_per_gparam=1e4, nvme_bytes_per_s=25e9),
}


@pytest.mark.parametrize("case", list(CASES))
def test_choice_between_nvme_checkpoints_and_8bit_states_follows_their_costs(case):
    problem = offload_problem(**CASES[case])
    joint = solve_milp(problem, backend="highs", gap=0.0, time_limit_s=30)
    no_q8 = problem.replace(allow_q8=False)
    no_nvme = problem.replace(nvme_bytes=0)
    only_nvme = solve_milp(no_q8, backend="highs", gap=0.0, time_limit_s=30)
    only_q8 = solve_milp(no_nvme, backend="highs", gap=0.0, time_limit_s=30)
    c_nvme, c_q8 = cost_ms(problem, only_nvme), cost_ms(problem, only_q8)
    assert cost_ms(problem, joint) == pytest.approx(min(c_nvme, c_q8), rel=1e-6)
    uses_nvme, uses_q8 = "nvme" in joint.tiers, bool(joint.q8_blocks)
    if case == "cheap_q8_slow_nvme":
        assert c_q8 < c_nvme and uses_q8 and not uses_nvme
        assert "dram" in joint.tiers  # the freed DRAM holds checkpoints
    else:
        assert c_nvme < c_q8 and uses_nvme and not uses_q8
