"""Plan provenance `host`: the host rates a plan assumed and its host-bound windows, checked
against windows worked out by hand (the 2-block problem of test_host_term.py), and the line the
plan summary and table print from it."""

from __future__ import annotations

import dataclasses

import pytest

from lazytrain.planner.evaluate import Decisions, build_plan
from lazytrain.planner.plan import SolveRecord
from lazytrain.planner.policy import PlannerOptions
from lazytrain.planner.problem import PlanningProblem
from lazytrain.report.plan_table import (
    format_plan_table, host_line, plan_comparison, plan_summary,
)

U = 10**7  # byte unit: 1 u = 1e7 bytes


def _problem(**kw) -> PlanningProblem:
    """2 blocks, every boundary in HBM. F = 10, Fg = 12, B = 20 ms; P = 200 u, G = 100 u;
    H2D and D2H 1e4 u/s (P: 20 ms, G: 10 ms); host conversion 2e3 u/s (P: 100 ms), host
    accumulation 1e3 u/s (G: 100 ms); embed 1 ms, head 4 ms; no keep."""
    base = dict(
        fwd_ms=(10.0, 10.0), fwd_grad_ms=(12.0, 12.0), bwd_ms=(20.0, 20.0),
        weight_bytes=(200 * U,) * 2, grad_bytes=(100 * U,) * 2, internal_bytes=(30 * U,) * 2,
        boundary_bytes=(50 * U,) * 3, params_per_block=(10**8,) * 2,
        embed_ms=1.0, head_ms=4.0,
        h2d_bytes_per_s=1e4 * U, d2h_bytes_per_s=1e4 * U, duplex_bytes_per_s=2e4 * U,
        nvme_read_bytes_per_s=5e3 * U, nvme_write_bytes_per_s=5e3 * U,
        host_convert_bytes_per_s=2e3 * U, host_accumulate_bytes_per_s=1e3 * U,
        hbm_bytes=10**13, fixed_hbm_bytes=0, dram_bytes=10**13, nvme_bytes=0,
        allow_keep=False,
    )
    base.update(kw)
    return PlanningProblem(**base)


def _plan(problem: PlanningProblem):
    return build_plan(problem, Decisions(tiers=("hbm",) * 3),
                      solver=SolveRecord(backend="manual"))


# Per window (compute ms; host ms = P / convert + G / accumulate):
#   f0 10 (H2D of P1 20 ms), f1 10, turn 4 (H2D 20), b1 32 (H2D 20), b0 32 (D2H of G1 10 ms).
#   Conversion at 2e3 u/s: host 100, 0, 100, 100, 100: the largest term wherever it is not 0.
#   Conversion at 2e4 u/s (P: 10 ms): host 10, 0, 10, 10, 100: below the H2D in f0 and turn,
#   below compute in b1; only b0's accumulation (100 ms) leads.
SLOW_BOUND = ["f0", "turn", "b1", "b0"]
FAST_BOUND = ["b0"]


@pytest.mark.parametrize("gpu", [True, False], ids=["gpu", "cpu"])
def test_host_bound_windows_by_hand(gpu):
    slow = _plan(_problem(copies_overlap_compute=gpu))
    assert [w.name for w in slow.windows] == ["f0", "f1", "turn", "b1", "b0"]
    host = slow.provenance["host"]
    assert host["bound_windows"] == SLOW_BOUND
    assert host["convert_bytes_per_s"] == 2e3 * U and host["accumulate_bytes_per_s"] == 1e3 * U
    assert host["host_ms"] == pytest.approx(400.0)
    fast = _plan(_problem(copies_overlap_compute=gpu, host_convert_bytes_per_s=2e4 * U))
    assert fast.provenance["host"]["bound_windows"] == FAST_BOUND
    assert fast.provenance["host"]["host_ms"] == pytest.approx(130.0)


def test_without_host_rates_no_window_is_host_bound():
    plan = _plan(_problem(host_convert_bytes_per_s=0.0, host_accumulate_bytes_per_s=0.0))
    assert plan.provenance["host"]["bound_windows"] == []
    assert host_line(plan) == ("host (assumed): convert not modelled, accumulate not modelled, "
                               "0.00 ms per micro-batch; host-bound windows (0 of 5): none")


def test_summary_and_table_print_the_assumed_rates_and_the_host_bound_windows():
    problem = _problem(host_convert_bytes_per_s=2e4 * U)
    plan = _plan(problem)
    # 2e4 u/s = 2e11 B/s = 200 GB/s; 1e3 u/s = 10 GB/s; host 10 + 10 + 10 + 100 = 130 ms
    want = ("host (assumed): convert 200 GB/s, accumulate 10 GB/s, 130.00 ms per micro-batch; "
            "host-bound windows (1 of 5): b0")
    assert f"  {want}" in plan_summary(plan).splitlines()
    options = PlannerOptions(policy="heuristic", lp_bound=False)
    table = format_plan_table(problem, plan, plan_comparison(problem, plan, options),
                              costs_line="costs: test")
    assert want in table.splitlines()


def test_a_plan_without_the_record_prints_no_host_line():
    plan = _plan(_problem())
    prov = dict(plan.provenance)
    del prov["host"]
    assert host_line(dataclasses.replace(plan, provenance=prov)) is None
